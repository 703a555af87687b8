//! Turning raw stdout/stderr bytes into `stdout`/`stderr` chunks (spec section 4).
//!
//! Chunks never split a UTF-8 sequence: an incomplete sequence at the end of a read is held back (at most 3 bytes)
//! until the next read. A chunk that is not valid UTF-8 is sent whole as base64. Decoding every chunk and
//! concatenating the bytes gives back the input exactly.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Serialize};

/// How a chunk's `data` is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputEncoding {
    /// `data` is the output itself (valid UTF-8). On the wire, `encoding` is left out.
    #[default]
    Utf8,
    /// `data` is the standard base64 (with padding) of output that is not valid UTF-8.
    Base64,
}

/// One chunk of output, ready to become a `stdout`/`stderr` message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The text, or its base64 when [`encoding`](Self::encoding) is [`OutputEncoding::Base64`].
    pub data: String,
    /// How `data` is encoded.
    pub encoding: OutputEncoding,
    /// How many raw output bytes the chunk carries (not the length of `data`).
    pub raw_len: usize,
}

impl Chunk {
    fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => Chunk {
                data: text.to_owned(),
                encoding: OutputEncoding::Utf8,
                raw_len: bytes.len(),
            },
            Err(_) => Chunk {
                data: STANDARD.encode(bytes),
                encoding: OutputEncoding::Base64,
                raw_len: bytes.len(),
            },
        }
    }

    /// The raw bytes the chunk carries.
    pub fn decode(&self) -> Result<Vec<u8>, base64::DecodeError> {
        match self.encoding {
            OutputEncoding::Utf8 => Ok(self.data.as_bytes().to_vec()),
            OutputEncoding::Base64 => STANDARD.decode(&self.data),
        }
    }
}

/// Cuts one output stream into [`Chunk`]s. Use one per stream; feed it each read, then call
/// [`finish`](Self::finish) at end of stream.
#[derive(Debug, Clone, Default)]
pub struct Utf8Chunker {
    /// Bytes of an incomplete but so far valid UTF-8 sequence from the end of the last read (at most 3).
    held: Vec<u8>,
}

impl Utf8Chunker {
    /// A chunker holding nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes read from the stream and returns what can be sent now, if anything.
    ///
    /// An incomplete UTF-8 sequence at the end is held back until the next call; the rest is one chunk, in
    /// base64 if it is not valid UTF-8.
    pub fn push(&mut self, bytes: &[u8]) -> Option<Chunk> {
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(bytes);
        let keep = incomplete_tail_len(&buf);
        self.held = buf.split_off(buf.len() - keep);
        (!buf.is_empty()).then(|| Chunk::from_bytes(&buf))
    }

    /// Flushes what is held at end of stream (base64, as it cannot be valid UTF-8 on its own).
    pub fn finish(&mut self) -> Option<Chunk> {
        let held = std::mem::take(&mut self.held);
        (!held.is_empty()).then(|| Chunk::from_bytes(&held))
    }

    /// How many bytes are held back waiting for the rest of their UTF-8 sequence.
    pub fn held_len(&self) -> usize {
        self.held.len()
    }
}

/// The length of the incomplete UTF-8 sequence that ends `buf`: a lead byte in the last 3 bytes followed only by
/// continuation bytes, forming a valid prefix of a sequence that the next bytes could complete. 0 if none.
fn incomplete_tail_len(buf: &[u8]) -> usize {
    for k in 1..=buf.len().min(3) {
        let start = buf.len() - k;
        if buf[start] & 0xC0 == 0x80 {
            continue;
        }
        return match std::str::from_utf8(&buf[start..]) {
            // `error_len() == None`: the input ended in the middle of a sequence that was valid so far.
            Err(e) if e.valid_up_to() == 0 && e.error_len().is_none() => k,
            _ => 0,
        };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `parts` through a chunker and returns the chunks, including the final flush.
    fn run(parts: &[&[u8]]) -> Vec<Chunk> {
        let mut chunker = Utf8Chunker::new();
        let mut chunks: Vec<Chunk> = parts.iter().filter_map(|p| chunker.push(p)).collect();
        assert!(chunker.held_len() <= 3);
        chunks.extend(chunker.finish());
        assert_eq!(chunker.held_len(), 0);
        chunks
    }

    fn reassemble(chunks: &[Chunk]) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in chunks {
            let bytes = chunk.decode().unwrap();
            assert_eq!(bytes.len(), chunk.raw_len);
            assert!(!bytes.is_empty(), "empty chunk");
            out.extend(bytes);
        }
        out
    }

    #[test]
    fn ascii_passes_through() {
        let chunks = run(&[b"hello ", b"world\n"]);
        assert_eq!(
            chunks,
            vec![
                Chunk {
                    data: "hello ".into(),
                    encoding: OutputEncoding::Utf8,
                    raw_len: 6
                },
                Chunk {
                    data: "world\n".into(),
                    encoding: OutputEncoding::Utf8,
                    raw_len: 6
                },
            ]
        );
    }

    #[test]
    fn empty_input_gives_nothing() {
        let mut chunker = Utf8Chunker::new();
        assert_eq!(chunker.push(b""), None);
        assert_eq!(chunker.finish(), None);
    }

    #[test]
    fn every_split_of_a_four_byte_char() {
        let input = "a😀b".as_bytes();
        assert_eq!(input.len(), 6);
        for i in 0..=input.len() {
            let chunks = run(&[&input[..i], &input[i..]]);
            assert!(
                chunks.iter().all(|c| c.encoding == OutputEncoding::Utf8),
                "split at {i}: {chunks:?}"
            );
            assert_eq!(reassemble(&chunks), input, "split at {i}");
            for j in i..=input.len() {
                let chunks = run(&[&input[..i], &input[i..j], &input[j..]]);
                assert!(
                    chunks.iter().all(|c| c.encoding == OutputEncoding::Utf8),
                    "split at {i},{j}"
                );
                assert_eq!(reassemble(&chunks), input, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn partial_char_is_held_then_completed() {
        let smile = "😀".as_bytes();
        let mut chunker = Utf8Chunker::new();
        assert_eq!(chunker.push(&smile[..1]), None);
        assert_eq!(chunker.push(&smile[1..2]), None);
        assert_eq!(chunker.push(&smile[2..3]), None);
        assert_eq!(chunker.held_len(), 3);
        let chunk = chunker.push(&smile[3..]).unwrap();
        assert_eq!(
            chunk,
            Chunk {
                data: "😀".into(),
                encoding: OutputEncoding::Utf8,
                raw_len: 4
            }
        );
        assert_eq!(chunker.finish(), None);

        let mut chunker = Utf8Chunker::new();
        let chunk = chunker
            .push("é€".as_bytes().split_last().unwrap().1)
            .unwrap();
        assert_eq!(chunk.data, "é");
        assert_eq!(chunker.held_len(), 2);
    }

    #[test]
    fn byte_at_a_time() {
        let input = "héllo wörld € 😀 日本語\n".as_bytes();
        let parts: Vec<&[u8]> = input.chunks(1).collect();
        let chunks = run(&parts);
        assert!(chunks.iter().all(|c| c.encoding == OutputEncoding::Utf8));
        assert_eq!(reassemble(&chunks), input);
    }

    #[test]
    fn invalid_bytes_are_sent_as_base64() {
        let chunks = run(&[&[0xFF, b'a']]);
        assert_eq!(
            chunks,
            vec![Chunk {
                data: "/2E=".into(),
                encoding: OutputEncoding::Base64,
                raw_len: 2
            }]
        );
        // A lone continuation byte, an overlong encoding, a surrogate.
        for bad in [
            &[0x80][..],
            &[0xC0, 0xAF],
            &[0xED, 0xA0, 0x80],
            &[b'x', 0xF8, b'y'],
        ] {
            let chunks = run(&[bad]);
            assert_eq!(chunks.len(), 1);
            assert_eq!(chunks[0].encoding, OutputEncoding::Base64, "{bad:?}");
            assert_eq!(reassemble(&chunks), bad);
        }
    }

    #[test]
    fn invalid_chunk_still_holds_back_an_incomplete_tail() {
        let smile = "😀".as_bytes();
        let mut chunker = Utf8Chunker::new();
        let first = chunker.push(&[0xFF, smile[0], smile[1]]).unwrap();
        assert_eq!(first.encoding, OutputEncoding::Base64);
        assert_eq!(first.decode().unwrap(), [0xFF]);
        assert_eq!(chunker.held_len(), 2);
        let second = chunker.push(&smile[2..]).unwrap();
        assert_eq!(
            second,
            Chunk {
                data: "😀".into(),
                encoding: OutputEncoding::Utf8,
                raw_len: 4
            }
        );
    }

    #[test]
    fn invalid_prefix_is_not_held() {
        // E0 must be followed by A0..BF; ED by 80..9F; F4 by 80..8F: these tails can never become valid.
        for tail in [
            &[0xE0, 0x80][..],
            &[0xED, 0xA0],
            &[0xF4, 0x90],
            &[0xF5],
            &[0xC1],
        ] {
            let mut chunker = Utf8Chunker::new();
            let chunk = chunker.push(tail).unwrap();
            assert_eq!(chunk.encoding, OutputEncoding::Base64, "{tail:?}");
            assert_eq!(chunker.held_len(), 0, "{tail:?}");
        }
        // A lead byte followed by a non-continuation byte: nothing to wait for.
        let chunks = run(&[&[b'a', 0xE2, b'b']]);
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].encoding, OutputEncoding::Base64);
    }

    #[test]
    fn finish_flushes_an_incomplete_tail_as_base64() {
        let mut chunker = Utf8Chunker::new();
        let chunk = chunker.push(b"ok\xE2\x82").unwrap();
        assert_eq!(chunk.data, "ok");
        let last = chunker.finish().unwrap();
        assert_eq!(
            last,
            Chunk {
                data: "4oI=".into(),
                encoding: OutputEncoding::Base64,
                raw_len: 2
            }
        );
        assert_eq!(chunker.finish(), None);
    }

    /// xorshift64*: a small deterministic generator, so the test needs no extra dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn random_splits<'a>(rng: &mut Rng, input: &'a [u8]) -> Vec<&'a [u8]> {
        let mut parts = Vec::new();
        let mut rest = input;
        while !rest.is_empty() {
            let n = rng.below(rest.len().min(9) + 1);
            let (part, tail) = rest.split_at(n);
            parts.push(part);
            rest = tail;
        }
        parts
    }

    #[test]
    fn random_valid_utf8_is_never_base64_and_reassembles() {
        let alphabet = [
            "a",
            "\n",
            "é",
            "ß",
            "€",
            "日",
            "😀",
            "𝄞",
            "\u{10FFFF}",
            "\u{7FF}",
            "\u{800}",
            "\u{FFFF}",
        ];
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..2000 {
            let len = rng.below(40);
            let text: String = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect();
            let parts = random_splits(&mut rng, text.as_bytes());
            let chunks = run(&parts);
            assert!(
                chunks.iter().all(|c| c.encoding == OutputEncoding::Utf8),
                "{text:?} {parts:?}"
            );
            assert_eq!(reassemble(&chunks), text.as_bytes());
        }
    }

    #[test]
    fn random_bytes_reassemble_exactly() {
        let mut rng = Rng(0xD1B5_4A32_D192_ED03);
        for _ in 0..5000 {
            let len = rng.below(48);
            let input: Vec<u8> = (0..len)
                .map(|_| match rng.below(4) {
                    // Bias towards bytes that make up multi-byte sequences.
                    0 => 0x80 | (rng.next() as u8 & 0x3F),
                    1 => 0xC0 | (rng.next() as u8 & 0x3F),
                    2 => b'a' + (rng.next() % 26) as u8,
                    _ => rng.next() as u8,
                })
                .collect();
            let parts = random_splits(&mut rng, &input);
            let chunks = run(&parts);
            assert_eq!(reassemble(&chunks), input, "{parts:?}");
            assert_eq!(chunks.iter().map(|c| c.raw_len).sum::<usize>(), input.len());
        }
    }
}
