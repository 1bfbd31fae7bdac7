//! Checks of the `.qstats` codec (`qforge_core::codec`), for the
//! `qstats_decode` target. Uses `qforge-core` only, so
//! `crates/core/tests/fuzz_corpus_replay.rs` can include it.

use qforge_core::codec;

/// Decodes `data` as a `.qstats` file and, separately, as the body of one
/// (sealed with a valid header and checksum); whatever decodes must
/// re-encode to exactly the bytes it came from.
///
/// The second form matters: random mutations almost never keep the CRC-32
/// valid, so without it the fuzzer would spend its time on the checksum
/// check and hardly ever reach the body's structural checks.
pub fn qstats_decode(data: &[u8]) {
    canonical(data);
    canonical(&seal(data));
}

/// Decoding `bytes` either fails or yields statistics that encode back to
/// `bytes` (the codec is canonical).
fn canonical(bytes: &[u8]) {
    if let Ok(stats) = codec::decode(bytes) {
        let again = codec::encode(&stats);
        assert!(
            again == bytes,
            "decode accepted a non-canonical encoding: {} bytes in, {} bytes re-encoded",
            bytes.len(),
            again.len()
        );
    }
}

/// `body` wrapped as a complete `.qstats` file: magic, version, length,
/// body, CRC-32 of everything before it.
pub fn seal(body: &[u8]) -> Vec<u8> {
    let mut out = codec::MAGIC.to_vec();
    out.extend_from_slice(&codec::FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}
