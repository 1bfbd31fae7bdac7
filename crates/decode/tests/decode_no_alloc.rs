//! The INT8 decode step allocates nothing: a counting global allocator sees
//! no allocation (on any thread) across decode steps of one and of several
//! sequences once the decoder has warmed up (its buffers grown to the
//! largest batch, the caches reserved).

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use qforge_decode::Decoder;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn int8_decode_steps_do_not_allocate() {
    let model = support::int8(&support::smollm2());
    let prompt: Vec<u32> = (0..16).map(|i| 300 + 41 * i).collect();
    let cache = support::prefilled_cache(&model, &prompt);
    assert!(Decoder::supports(&model), "all INT8");
    let mut decoder = Decoder::new(2).unwrap();
    // Four sequences at different lengths, batched, then one alone: the
    // buffers grow to the largest batch while warming up.
    let mut caches = vec![cache.clone(); 4];
    for (i, cache) in caches.iter_mut().enumerate() {
        cache.reserve(64);
        for token in 0..i as u32 {
            decoder.step(&model, &mut [cache], &[token], None).unwrap();
        }
    }
    let mut caches: Vec<&mut _> = caches.iter_mut().collect();
    for token in 7..15u32 {
        decoder
            .step(&model, &mut caches, &[token; 4], None)
            .unwrap();
    }
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    let mut checksum = 0f32;
    for token in 100..116u32 {
        checksum += decoder
            .step(&model, &mut caches, &[token; 4], None)
            .unwrap()[0];
        checksum += decoder
            .step(&model, &mut caches[..1], &[token], None)
            .unwrap()[0];
    }
    let allocations = ALLOCATIONS.load(Ordering::SeqCst) - before;
    assert!(checksum.is_finite());
    assert_eq!(
        allocations, 0,
        "{allocations} allocations in 32 decode steps"
    );
}
