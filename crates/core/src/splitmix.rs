//! SplitMix64 (Steele, Lea and Flood, 2014; Vigna's reference
//! `splitmix64.c`): the stream for every draw that is part of qforge's
//! output. The plan's shuffle, the determinism fingerprint's probe inputs
//! and a rotation's signs (an artifact records only the seed) follow from
//! it, so what it draws for a seed must never change. It is a few integer
//! operations, the same on every platform and forever, which `rand`'s
//! `StdRng` does not promise across versions (sampling, where a seed need
//! only repeat within one build, uses that).

/// The stream's increment: 2⁶⁴ divided by the golden ratio, odd.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// A SplitMix64 stream: each draw adds a fixed odd increment (2⁶⁴ over the
/// golden ratio) to the state and returns the [`mix`] of the new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream seeded with `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next draw.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix(self.state)
    }
}

/// SplitMix64's output function (Stafford's "Mix13" finalizer): a bijection
/// of `u64` in which every input bit flips each output bit with probability
/// close to ½, so it also serves alone as a stable hash of a `u64`.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(seed: u64) -> [u64; 5] {
        let mut stream = SplitMix64::new(seed);
        std::array::from_fn(|_| stream.next_u64())
    }

    #[test]
    fn draws_equal_the_reference_implementation() {
        // Vigna's splitmix64.c from seed 1234567 (the values Rosetta Code
        // lists), and from seed 0.
        assert_eq!(
            draws(1_234_567),
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
        assert_eq!(
            draws(0),
            [
                0xE220_A839_7B1D_CDAF,
                0x6E78_9E6A_A1B9_65F4,
                0x06C4_5D18_8009_454F,
                0xF88B_B8A8_724C_81EC,
                0x1B39_896A_51A8_749B,
            ]
        );
    }

    #[test]
    fn a_draw_is_the_mix_of_the_advanced_state() {
        assert_eq!(mix(0), 0);
        assert_eq!(mix(GAMMA), draws(0)[0]);
        assert_eq!(mix(GAMMA.wrapping_mul(2)), draws(0)[1]);
    }
}
