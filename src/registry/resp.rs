//! RESP2, the Redis wire protocol, without I/O: an encoder for commands and a bounded parser
//! for replies.
//!
//! Commands are arrays of bulk strings ([`encode`]). Replies are parsed by [`parse`] from the
//! bytes received so far: it returns the first complete reply and how many bytes it used, or
//! `None` when more bytes are needed, so a reply split across any number of reads is handled by
//! feeding the bytes to a [`Decoder`] as they come. Everything the server sends is checked
//! before use: a bulk string or array longer than the [`Limits`], a reply nested deeper than
//! them, a line without its `\r\n`, a bad integer or an unknown type byte is a typed
//! [`RespError`], never a panic and never an allocation sized by the peer.
//!
//! The parser starts again from the first byte of a reply each time more bytes arrive: simple,
//! and cheap for the replies a registry gets (a few KiB); a reply of `n` bytes arriving in `k`
//! reads costs `O(n·k)`, bounded by [`Limits::max_reply`].

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    /// `+OK`: a simple string (no `\r` or `\n` inside).
    Simple(Vec<u8>),
    /// `-ERR ...`: an error reply, as text (lossily decoded).
    Error(String),
    /// `:42`: an integer.
    Integer(i64),
    /// `$3\r\nfoo`: a bulk string.
    Bulk(Vec<u8>),
    /// `$-1` or `*-1`: the null bulk string or null array.
    Nil,
    /// `*2\r\n...`: an array of replies.
    Array(Vec<Value>),
}

/// Caps on what one reply may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Longest bulk string, in bytes.
    pub(crate) max_bulk: usize,
    /// Most array elements in one reply, all levels together.
    pub(crate) max_elements: usize,
    /// Deepest nesting of arrays (1: an array of scalars).
    pub(crate) max_depth: usize,
    /// Longest simple string, error or integer line, in bytes.
    pub(crate) max_line: usize,
    /// Most bytes one reply may take on the wire (and so the most the decoder buffers).
    pub(crate) max_reply: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bulk: 4 << 20,
            max_elements: 1 << 20,
            max_depth: 4,
            max_line: 64 << 10,
            max_reply: 64 << 20,
        }
    }
}

/// Why a reply could not be parsed. After any of these the connection is out of step with
/// the server and must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RespError {
    /// The first byte of a reply is not one of `+ - : $ *`.
    #[error("unknown reply type byte {0:#04x}")]
    UnknownType(u8),
    /// A line is not terminated by `\r\n`, or a length or integer is not a decimal number.
    #[error("malformed reply: {0}")]
    Malformed(&'static str),
    /// A line is longer than [`Limits::max_line`].
    #[error("reply line longer than {max} bytes")]
    LineTooLong {
        /// The limit.
        max: usize,
    },
    /// A bulk string longer than [`Limits::max_bulk`].
    #[error("bulk string of {len} bytes exceeds the limit of {max}")]
    BulkTooLarge {
        /// Its announced length.
        len: i64,
        /// The limit.
        max: usize,
    },
    /// More array elements than [`Limits::max_elements`].
    #[error("reply with more than {max} array elements")]
    TooManyElements {
        /// The limit.
        max: usize,
    },
    /// Arrays nested deeper than [`Limits::max_depth`].
    #[error("reply nested deeper than {max} levels")]
    TooDeep {
        /// The limit.
        max: usize,
    },
    /// A reply longer than [`Limits::max_reply`].
    #[error("reply larger than {max} bytes")]
    TooLarge {
        /// The limit.
        max: usize,
    },
}

/// Replies parsed out of a byte stream fed in arbitrary pieces.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    buf: Vec<u8>,
    limits: Limits,
}

/// Parse state: the bytes, the position, and the budget left for elements.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    elements: usize,
    limits: &'a Limits,
}

/// A parse step's outcome: `Ok(None)` means more bytes are needed.
type Step<T> = Result<Option<T>, RespError>;

impl Decoder {
    /// A decoder with these limits.
    pub(crate) fn new(limits: Limits) -> Self {
        Decoder {
            buf: Vec::new(),
            limits,
        }
    }

    /// Appends bytes received from the server.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete reply, `Ok(None)` if more bytes are needed.
    pub(crate) fn next_reply(&mut self) -> Result<Option<Value>, RespError> {
        match parse(&self.buf, &self.limits)? {
            Some((value, used)) => {
                self.buf.drain(..used);
                Ok(Some(value))
            }
            None => Ok(None),
        }
    }

    /// Bytes received but not yet returned as a reply.
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }
}

impl<'a> Cursor<'a> {
    /// The bytes of the line starting at `pos`, without its `\r\n`.
    fn line(&mut self) -> Step<&'a [u8]> {
        let rest = &self.buf[self.pos..];
        let window = &rest[..rest.len().min(self.limits.max_line + 2)];
        match window.iter().position(|&b| b == b'\n') {
            Some(nl) => {
                if nl == 0 || window[nl - 1] != b'\r' {
                    return Err(RespError::Malformed("line not terminated by \\r\\n"));
                }
                let line = &rest[..nl - 1];
                if line.contains(&b'\r') {
                    return Err(RespError::Malformed("stray \\r inside a line"));
                }
                self.pos += nl + 1;
                Ok(Some(line))
            }
            None if window.len() >= self.limits.max_line + 2 => Err(RespError::LineTooLong {
                max: self.limits.max_line,
            }),
            None => Ok(None),
        }
    }

    fn value(&mut self, depth: usize) -> Step<Value> {
        let Some(&kind) = self.buf.get(self.pos) else {
            return Ok(None);
        };
        if !b"+-:$*".contains(&kind) {
            return Err(RespError::UnknownType(kind));
        }
        self.pos += 1;
        let Some(line) = self.line()? else {
            return Ok(None);
        };
        match kind {
            b'+' => Ok(Some(Value::Simple(line.to_vec()))),
            b'-' => Ok(Some(Value::Error(
                String::from_utf8_lossy(line).into_owned(),
            ))),
            b':' => Ok(Some(Value::Integer(integer(line)?))),
            b'$' => self.bulk(integer(line)?),
            // `*`, the only type byte left (checked above).
            _ => self.array(integer(line)?, depth),
        }
    }

    fn bulk(&mut self, len: i64) -> Step<Value> {
        if len == -1 {
            return Ok(Some(Value::Nil));
        }
        let len = usize::try_from(len)
            .map_err(|_| RespError::Malformed("negative bulk string length"))?;
        if len > self.limits.max_bulk {
            return Err(RespError::BulkTooLarge {
                len: len as i64,
                max: self.limits.max_bulk,
            });
        }
        let rest = &self.buf[self.pos..];
        // `len` is at most `max_bulk`, so `len + 2` does not overflow.
        if rest.len() < len + 2 {
            return Ok(None);
        }
        if &rest[len..len + 2] != b"\r\n" {
            return Err(RespError::Malformed("bulk string not terminated by \\r\\n"));
        }
        self.pos += len + 2;
        Ok(Some(Value::Bulk(rest[..len].to_vec())))
    }

    fn array(&mut self, len: i64, depth: usize) -> Step<Value> {
        if len == -1 {
            return Ok(Some(Value::Nil));
        }
        let len =
            usize::try_from(len).map_err(|_| RespError::Malformed("negative array length"))?;
        if depth >= self.limits.max_depth {
            return Err(RespError::TooDeep {
                max: self.limits.max_depth,
            });
        }
        if len > self.elements {
            return Err(RespError::TooManyElements {
                max: self.limits.max_elements,
            });
        }
        self.elements -= len;
        // Each element takes at least 3 bytes (`:0\r\n` is 4), so never reserve more than the
        // bytes received could hold: the peer does not size our allocations.
        let mut items = Vec::with_capacity(len.min((self.buf.len() - self.pos) / 3));
        for _ in 0..len {
            match self.value(depth + 1)? {
                Some(v) => items.push(v),
                None => return Ok(None),
            }
        }
        Ok(Some(Value::Array(items)))
    }
}

/// Appends `args` to `out` as one command (an array of bulk strings).
pub(crate) fn encode(args: &[&[u8]], out: &mut Vec<u8>) {
    out.push(b'*');
    out.extend_from_slice(args.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for arg in args {
        out.push(b'$');
        out.extend_from_slice(arg.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// The first complete reply in `buf` and the number of bytes it takes, or `None` if `buf`
/// holds only part of one.
pub(crate) fn parse(buf: &[u8], limits: &Limits) -> Result<Option<(Value, usize)>, RespError> {
    let mut cursor = Cursor {
        buf,
        pos: 0,
        elements: limits.max_elements,
        limits,
    };
    match cursor.value(0)? {
        Some(_) if cursor.pos > limits.max_reply => Err(RespError::TooLarge {
            max: limits.max_reply,
        }),
        Some(v) => Ok(Some((v, cursor.pos))),
        None if buf.len() > limits.max_reply => Err(RespError::TooLarge {
            max: limits.max_reply,
        }),
        None => Ok(None),
    }
}

/// A RESP integer line: an optional `-` and 1 to 19 decimal digits, no overflow.
fn integer(line: &[u8]) -> Result<i64, RespError> {
    let (negative, digits) = match line.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, line),
    };
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(RespError::Malformed("not a decimal integer"));
    }
    let mut n: i64 = 0;
    for &d in digits {
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_add(i64::from(d - b'0')))
            .ok_or(RespError::Malformed("integer out of range"))?;
    }
    Ok(if negative { -n } else { n })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // A test may panic: a panic is a failure it reports.

    use super::*;

    fn one(bytes: &[u8]) -> Result<Option<(Value, usize)>, RespError> {
        parse(bytes, &Limits::default())
    }

    /// A reply with every type, nested.
    const MIXED: &[u8] =
        b"*6\r\n+OK\r\n-ERR wrong\r\n:-42\r\n$5\r\nh\r\nlo\r\n$-1\r\n*2\r\n$0\r\n\r\n*-1\r\n";

    fn mixed() -> Value {
        Value::Array(vec![
            Value::Simple(b"OK".to_vec()),
            Value::Error("ERR wrong".into()),
            Value::Integer(-42),
            Value::Bulk(b"h\r\nlo".to_vec()),
            Value::Nil,
            Value::Array(vec![Value::Bulk(Vec::new()), Value::Nil]),
        ])
    }

    #[test]
    fn encodes_commands_as_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        encode(&[b"SET", b"k", b"a b\r\n"], &mut out);
        encode(&[b"PING"], &mut out);
        assert_eq!(
            out,
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\na b\r\n\r\n*1\r\n$4\r\nPING\r\n"
        );
    }

    #[test]
    fn parses_every_type() {
        assert_eq!(one(MIXED).unwrap(), Some((mixed(), MIXED.len())));
        assert_eq!(
            one(b":9223372036854775807\r\n").unwrap().unwrap().0,
            Value::Integer(i64::MAX)
        );
    }

    #[test]
    fn every_prefix_is_incomplete_and_every_split_decodes() {
        for cut in 0..MIXED.len() {
            assert_eq!(one(&MIXED[..cut]).unwrap(), None, "prefix of {cut} bytes");
            let mut d = Decoder::default();
            d.feed(&MIXED[..cut]);
            assert_eq!(d.next_reply().unwrap(), None);
            d.feed(&MIXED[cut..]);
            assert_eq!(d.next_reply().unwrap(), Some(mixed()));
            assert_eq!(d.buffered(), 0);
        }
    }

    #[test]
    fn byte_at_a_time_with_replies_back_to_back() {
        let mut d = Decoder::default();
        let mut got = Vec::new();
        let stream = [MIXED, b"+QUEUED\r\n", MIXED].concat();
        for b in &stream {
            d.feed(std::slice::from_ref(b));
            while let Some(v) = d.next_reply().unwrap() {
                got.push(v);
            }
        }
        assert_eq!(
            got,
            vec![mixed(), Value::Simple(b"QUEUED".to_vec()), mixed()]
        );
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        let cases: &[(&[u8], RespError)] = &[
            (b"?x\r\n", RespError::UnknownType(b'?')),
            (b"%1\r\n", RespError::UnknownType(b'%')),
            (
                b"+OK\n",
                RespError::Malformed("line not terminated by \\r\\n"),
            ),
            (b"\n", RespError::UnknownType(b'\n')),
            (
                b"+O\rK\r\n",
                RespError::Malformed("stray \\r inside a line"),
            ),
            (b":\r\n", RespError::Malformed("not a decimal integer")),
            (b":+1\r\n", RespError::Malformed("not a decimal integer")),
            (b":1x\r\n", RespError::Malformed("not a decimal integer")),
            (
                b":9223372036854775808\r\n",
                RespError::Malformed("integer out of range"),
            ),
            (
                b":99999999999999999999\r\n",
                RespError::Malformed("not a decimal integer"),
            ),
            (
                b"$-2\r\n",
                RespError::Malformed("negative bulk string length"),
            ),
            (b"*-7\r\n", RespError::Malformed("negative array length")),
            (
                b"$3\r\nabcd\r\n",
                RespError::Malformed("bulk string not terminated by \\r\\n"),
            ),
            (b"*1\r\n!\r\n", RespError::UnknownType(b'!')),
        ];
        for (bytes, want) in cases {
            assert_eq!(
                one(bytes).unwrap_err(),
                *want,
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn limits_are_enforced_before_allocating() {
        let small = Limits {
            max_bulk: 8,
            max_elements: 4,
            max_depth: 2,
            max_line: 16,
            max_reply: 48,
        };
        let p = |b: &[u8]| parse(b, &small);
        assert_eq!(p(b"$8\r\n12345678\r\n").unwrap().unwrap().1, 14);
        assert_eq!(
            p(b"$9\r\n").unwrap_err(),
            RespError::BulkTooLarge { len: 9, max: 8 }
        );
        assert_eq!(
            one(b"$9223372036854775807\r\n").unwrap_err(),
            RespError::BulkTooLarge {
                len: i64::MAX,
                max: Limits::default().max_bulk
            }
        );
        assert_eq!(
            one(b"*9223372036854775807\r\n").unwrap_err(),
            RespError::TooManyElements {
                max: Limits::default().max_elements
            }
        );
        assert_eq!(
            p(b"*2\r\n*3\r\n").unwrap_err(),
            RespError::TooManyElements { max: 4 }
        );
        assert!(p(b"*2\r\n*2\r\n:1\r\n:2\r\n:3\r\n").unwrap().is_some());
        assert_eq!(
            p(b"*1\r\n*1\r\n*1\r\n").unwrap_err(),
            RespError::TooDeep { max: 2 }
        );
        assert_eq!(
            p(b"+0123456789abcdefXY").unwrap_err(),
            RespError::LineTooLong { max: 16 }
        );
        assert_eq!(p(b"+0123456789abcdef").unwrap(), None);
        let long = [b"*4\r\n".as_slice(), &b"$8\r\n12345678\r\n".repeat(4)].concat();
        assert_eq!(p(&long).unwrap_err(), RespError::TooLarge { max: 48 });
        assert_eq!(p(&long[..47]).unwrap(), None);
        assert_eq!(p(&long[..49]).unwrap_err(), RespError::TooLarge { max: 48 });
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A deterministic pseudo-random walk over short inputs made of RESP's own symbols.
        let alphabet = b"+-:$*\r\n0123456789-x";
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let limits = Limits {
            max_bulk: 16,
            max_elements: 8,
            max_depth: 3,
            max_line: 8,
            max_reply: 48,
        };
        for _ in 0..50_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 24) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| {
                    alphabet[((state >> (i % 8 * 8)) as usize).wrapping_add(i) % alphabet.len()]
                })
                .collect();
            if let Ok(Some((_, used))) = parse(&bytes, &limits) {
                assert!(used <= bytes.len());
            }
        }
    }
}
