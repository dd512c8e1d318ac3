//! Connection handshake with pre-shared-key authentication.
//!
//! # Exchange
//!
//! ```text
//! client                                   server
//!   Hello { versions, node, incarnation, shards, features, nonce_c }  ──▶
//!   ◀──  Welcome { version, node, incarnation, shards, features, nonce_s, echo nonce_c,
//!                  proof_s = HMAC(psk, "shardcx-welcome\0" ‖ hello ‖ welcome[..96]) }
//!   Confirm { echo nonce_s, proof_c = HMAC(psk, "shardcx-confirm\0" ‖ hello ‖ welcome ‖ confirm[..32]) } ──▶
//! ```
//!
//! Either side may answer with `Reject { reason, versions, echo nonce }` instead. HMAC is
//! HMAC-SHA-256 from the RustCrypto `hmac` and `sha2` crates; proofs are checked with
//! `verify_slice`, which compares in constant time. Each proof covers the whole transcript so
//! far, including the other side's fresh nonce, so a recorded proof is useless in a later
//! handshake. The client becomes ready after verifying the welcome and sending the confirm; the
//! server after verifying the confirm. Both therefore prove knowledge of the key.
//!
//! The wire version is negotiated: the server picks the highest version in both ranges, or
//! rejects with [`RejectReason::VersionMismatch`] carrying its own range. Features are
//! negotiated as the intersection of both sides' bits.
//!
//! Every message except `Hello` echoes the nonce of the attempt it answers. A message whose echo
//! does not match the current attempt is a leftover from an earlier attempt (duplicated or
//! delayed by the network) and is ignored rather than failing the handshake; it is counted in
//! [`Handshake::ignored`].
//!
//! Threat model: the key keeps unconfigured or misconfigured nodes out of the cluster. Frames
//! after the handshake are not authenticated (UCX transports are not), so an attacker on the path
//! can still inject frames or forge a `Reject`; a forged reject only costs a reconnect attempt.
//!
//! # Sessions and rails
//!
//! Authentication happens once per node pair; the connections that carry the pair's traffic
//! are *rails*, one per (local shard, remote shard) pair of [`crate::Rails`]. The exchange above
//! runs on one of them, the *primary*, and leaves both sides with the same 32-byte
//! [`SessionSecret`]:
//!
//! ```text
//! secret = HMAC(psk, "shardcx-session\0" ‖ hello ‖ welcome ‖ confirm)
//! ```
//!
//! over the three messages as sent. It covers both fresh nonces, so every handshake makes a new
//! one; it never travels, and it is independent of the proofs (another label). The net layer
//! keeps it with the session's [`PeerInfo`] in a node-wide table, and every other rail *joins*
//! the session with a two-message exchange keyed by it:
//!
//! ```text
//! client (shard s of A)                                        server (shard r of B)
//!   Join { version, node, incarnation, server_incarnation, shards, nonce_j,
//!          proof_j = HMAC(secret, "shardcx-join\0" ‖ join[..64] ‖ s u16 ‖ r u16) }  ──▶
//!   ◀──  Joined { echo nonce_j, proof = HMAC(secret, "shardcx-joined\0" ‖ join ‖ joined[..32]) }
//! ```
//!
//! `s` and `r` are the rail's shards (little-endian), as written in the Join frame's header
//! (`src_shard`, `dst_shard`). The server ([`accept_join`]) checks, in this order:
//!
//! 1. the join names the session it holds: node, the client's incarnation and the server's own
//!    (a restarted server has a new incarnation, so no session from its previous life is
//!    accepted), shard count, wire version, and [`Features::RAILS`] negotiated in it — else
//!    `Reject` [`RejectReason::UnknownSession`], on which the client falls back to a full
//!    handshake;
//! 2. `(r, s)` is a rail of the pair — else [`RejectReason::NoSuchRail`];
//! 3. the proof — else [`RejectReason::BadProof`].
//!
//! The client ([`JoinAttempt`]) accepts a `Joined` that echoes its nonce and whose proof
//! verifies, or fails on a `Reject` echoing its nonce, or at the handshake deadline.
//!
//! Threat model of joins: only a holder of the secret, so of the key, can make a Join or a
//! Joined that verifies. The exchange has no server challenge, so a Join recorded on the wire
//! can be **replayed** on a new endpoint while its session lives; the server then accepts a rail
//! from an endpoint that never proved anything. This is within the threat model above: frames
//! after the handshake are not authenticated anyway, and the replayer gains nothing it could not
//! get by injecting frames into an existing rail. A replay cannot join another rail (the shards
//! are in the proof), another node pair or incarnation, or a later session (the secret is fresh
//! per handshake).
//!
//! # Payload layouts (little-endian)
//!
//! ```text
//! Hello   (64 B):  0 min_version u8 | 1 max_version u8 | 2 shard_count u16 | 4 reserved u32 = 0
//!                  8 node_id u64 | 16 incarnation u64 | 24 features u64 | 32 nonce [32]
//! Welcome (128 B): 0 version u8 | 1 reserved u8 = 0 | 2 shard_count u16 | 4 reserved u32 = 0
//!                  8 node_id u64 | 16 incarnation u64 | 24 features u64 | 32 nonce [32]
//!                  64 echo [32] | 96 proof [32]
//! Confirm (64 B):  0 echo [32] | 32 proof [32]
//! Reject  (40 B):  0 reason u8 | 1 min_version u8 | 2 max_version u8 | 3 reserved u8 = 0
//!                  4 reserved u32 = 0 | 8 echo [32]
//! Join    (96 B):  0 version u8 | 1 reserved u8 = 0 | 2 shard_count u16 | 4 reserved u32 = 0
//!                  8 node_id u64 | 16 incarnation u64 | 24 server_incarnation u64
//!                  32 nonce [32] | 64 proof [32]
//! Joined  (64 B):  0 echo [32] | 32 proof [32]
//! ```
//!
//! In a Join, `version` is the session's negotiated wire version, `node_id`, `incarnation` and
//! `shard_count` are the client node's, and `server_incarnation` is the server's incarnation
//! as the client learned it in the session's handshake. Reject reason codes: 1 bad proof,
//! 2 version mismatch, 3 bad shard count, 4 wrong node, 5 busy, 6 shutdown, 7 unknown session,
//! 8 no such rail; other codes are kept as [`RejectReason::Other`].
//!
//! # Calling order
//!
//! [`Handshake`] follows the crate's sans-IO pattern: create it with [`Handshake::client`] or
//! [`Handshake::server`]; feed it every received handshake message with
//! [`Handshake::handle_message`] and call [`Handshake::handle_timeout`] when
//! [`Handshake::poll_timeout`] is reached; after each input drain [`Handshake::poll_transmit`]
//! and check [`Handshake::outcome`]. [`JoinAttempt`] (the client side of a join) is driven the
//! same way; the server side of a join is the single call [`accept_join`]. [`crate::Connection`]
//! does all of this for you.

use crate::ids::{Incarnation, NodeId, ShardId};
use crate::rails::{Rail, Rails};
use crate::shard_map::MAX_SHARDS;
use crate::time::Timestamp;
use crate::wire::{read_u16, read_u64, FrameKind, WireError, MAX_WIRE_VERSION, MIN_WIRE_VERSION};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

type HmacSha256 = Hmac<Sha256>;

/// Size of a nonce.
pub const NONCE_LEN: usize = 32;
/// Size of a proof (HMAC-SHA-256 output).
pub const PROOF_LEN: usize = 32;
/// Minimum length of a pre-shared key.
pub const MIN_PSK_LEN: usize = 16;
/// Encoded size of [`Hello`].
pub const HELLO_LEN: usize = 64;
/// Encoded size of [`Welcome`].
pub const WELCOME_LEN: usize = 128;
/// Encoded size of [`Confirm`].
pub const CONFIRM_LEN: usize = 64;
/// Encoded size of [`Reject`].
pub const REJECT_LEN: usize = 40;
/// Encoded size of [`Join`].
pub const JOIN_LEN: usize = 96;
/// Encoded size of [`Joined`].
pub const JOINED_LEN: usize = 64;
/// Size of a [`SessionSecret`].
pub const SESSION_SECRET_LEN: usize = 32;
/// The largest handshake payload.
pub const MAX_HANDSHAKE_LEN: usize = WELCOME_LEN;

const WELCOME_LABEL: &[u8] = b"shardcx-welcome\0";
const CONFIRM_LABEL: &[u8] = b"shardcx-confirm\0";
const NONCE_LABEL: &[u8] = b"shardcx-nonce\0";
const SESSION_LABEL: &[u8] = b"shardcx-session\0";
const JOIN_LABEL: &[u8] = b"shardcx-join\0";
const JOINED_LABEL: &[u8] = b"shardcx-joined\0";
/// The signed part of a [`Join`]: everything before its proof.
const JOIN_SIGNED_LEN: usize = JOIN_LEN - PROOF_LEN;

/// A 32-byte handshake nonce.
pub type Nonce = [u8; NONCE_LEN];

/// Feature bits (a `u64` bit set). Unknown bits are kept: they are features of newer builds and
/// drop out of the negotiated intersection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Features(u64);

/// The cluster's pre-shared key. Cheap to clone; `Debug` does not print it.
#[derive(Clone)]
pub struct PreSharedKey(Arc<[u8]>);

/// The secret of an authenticated session between two nodes, derived by both sides of a
/// completed hello / welcome / confirm exchange (see the module docs) and used as the HMAC key
/// of the [`Join`] / [`Joined`] proofs of the session's other rails.
///
/// `Debug` does not print it. Equality is not constant-time: the secret is only ever used as an
/// HMAC key (proofs are checked with HMAC's own constant-time comparison), and `==` is for
/// tests.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionSecret([u8; SESSION_SECRET_LEN]);

/// Why a handshake was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// A proof did not verify: the sides hold different keys.
    BadProof,
    /// No wire version in common.
    VersionMismatch,
    /// The announced shard count is outside `1..=MAX_SHARDS`.
    BadShardCount,
    /// The welcome came from a node other than the one dialled.
    WrongNode,
    /// The server is at capacity.
    Busy,
    /// The server is shutting down.
    Shutdown,
    /// A [`Join`] names no session the server holds (node, incarnations, shard count, version,
    /// or rails not negotiated): the client should run a full handshake.
    UnknownSession,
    /// The frame's shards are not a rail of this node pair (see [`crate::Rails`]).
    NoSuchRail,
    /// The server dropped this node for misbehaviour (it kept sending frames the server had
    /// to refuse) and refuses it for a while.
    Banned,
    /// A reason this build does not know (code kept).
    Other(u8),
}

/// Client's first message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hello {
    /// Oldest wire version the client speaks.
    pub min_version: u8,
    /// Newest wire version the client speaks.
    pub max_version: u8,
    /// The client node's shard count.
    pub shard_count: u16,
    /// The client node.
    pub node_id: NodeId,
    /// The client node's incarnation.
    pub incarnation: Incarnation,
    /// The client's feature bits.
    pub features: Features,
    /// The client's fresh nonce.
    pub nonce: Nonce,
}

/// Server's answer to a [`Hello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Welcome {
    /// The negotiated wire version.
    pub version: u8,
    /// The server node's shard count.
    pub shard_count: u16,
    /// The server node.
    pub node_id: NodeId,
    /// The server node's incarnation.
    pub incarnation: Incarnation,
    /// The server's feature bits.
    pub features: Features,
    /// The server's fresh nonce.
    pub nonce: Nonce,
    /// The client's nonce, echoed.
    pub echo: Nonce,
    /// HMAC over the hello and the welcome's first 96 bytes.
    pub proof: [u8; PROOF_LEN],
}

/// Client's proof, answering a [`Welcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Confirm {
    /// The server's nonce, echoed.
    pub echo: Nonce,
    /// HMAC over hello, welcome and the echo.
    pub proof: [u8; PROOF_LEN],
}

/// A refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reject {
    /// Why.
    pub reason: RejectReason,
    /// Oldest wire version the rejecting side speaks.
    pub min_version: u8,
    /// Newest wire version the rejecting side speaks.
    pub max_version: u8,
    /// The nonce of the attempt being rejected (the receiver's own nonce).
    pub echo: Nonce,
}

/// A rail's request to join an authenticated session (client → server). See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Join {
    /// The session's negotiated wire version.
    pub version: u8,
    /// The client node's shard count.
    pub shard_count: u16,
    /// The client node.
    pub node_id: NodeId,
    /// The client node's incarnation.
    pub incarnation: Incarnation,
    /// The server's incarnation when the session was made.
    pub server_incarnation: Incarnation,
    /// The client's fresh nonce.
    pub nonce: Nonce,
    /// HMAC under the session secret over the first 64 bytes and the rail's shards.
    pub proof: [u8; PROOF_LEN],
}

/// The server's acceptance of a [`Join`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Joined {
    /// The join's nonce, echoed.
    pub echo: Nonce,
    /// HMAC under the session secret over the join and the echo.
    pub proof: [u8; PROOF_LEN],
}

/// Any handshake message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(clippy::large_enum_variant)] // Short-lived values; boxing would allocate per handshake.
pub enum HandshakeMessage {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Welcome`].
    Welcome(Welcome),
    /// See [`Confirm`].
    Confirm(Confirm),
    /// See [`Reject`].
    Reject(Reject),
    /// See [`Join`].
    Join(Join),
    /// See [`Joined`].
    Joined(Joined),
}

/// Handshake failures, including decode errors for handshake payloads.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The frame kind is not a handshake kind.
    #[error("frame kind {kind:?} is not a handshake message")]
    NotHandshake {
        /// The kind given.
        kind: FrameKind,
    },
    /// The payload has the wrong length for its kind.
    #[error("{kind:?} payload of {got} bytes, expected {expected}")]
    BadLength {
        /// The message kind.
        kind: FrameKind,
        /// Required length.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// A reserved field is not zero.
    #[error("{kind:?} reserved field at offset {offset} is not zero")]
    ReservedNonZero {
        /// The message kind.
        kind: FrameKind,
        /// Offset of the field.
        offset: usize,
    },
    /// Encoding into a too-small buffer, and similar wire-level errors.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The pre-shared key is shorter than [`MIN_PSK_LEN`].
    #[error("pre-shared key of {len} bytes is shorter than {min}")]
    WeakKey {
        /// Length given.
        len: usize,
        /// Minimum.
        min: usize,
    },
    /// The peer's proof did not verify.
    #[error("peer's proof does not verify")]
    BadProof,
    /// No common wire version.
    #[error(
        "no common wire version: ours {ours_min}..={ours_max}, theirs {theirs_min}..={theirs_max}"
    )]
    VersionMismatch {
        /// Our oldest.
        ours_min: u8,
        /// Our newest.
        ours_max: u8,
        /// Their oldest.
        theirs_min: u8,
        /// Their newest.
        theirs_max: u8,
    },
    /// The peer announced an invalid shard count.
    #[error("peer announced shard count {shard_count}")]
    BadShardCount {
        /// The count announced.
        shard_count: u16,
    },
    /// The welcome came from an unexpected node.
    #[error("expected node {expected}, got {got}")]
    WrongPeer {
        /// The node dialled.
        expected: NodeId,
        /// The node that answered.
        got: NodeId,
    },
    /// The peer refused.
    #[error("rejected by peer: {reason:?}")]
    Rejected {
        /// The peer's reason.
        reason: RejectReason,
    },
    /// The handshake deadline passed.
    #[error("handshake timed out")]
    Timeout,
    /// A join named no session that rails may join (see [`RejectReason::UnknownSession`]).
    #[error("join names no session held here")]
    UnknownSession,
    /// The shards of a join or hello are not a rail of the node pair.
    #[error("shards (local {local}, remote {remote}) are not a rail of this pair")]
    NoSuchRail {
        /// This side's shard.
        local: ShardId,
        /// The other side's shard.
        remote: ShardId,
    },
}

/// What a handshake side needs to know about itself.
#[derive(Clone, Debug)]
pub struct HandshakeConfig {
    /// This node.
    pub node_id: NodeId,
    /// This node's incarnation.
    pub incarnation: Incarnation,
    /// This node's shard count.
    pub shard_count: u16,
    /// This node's features.
    pub features: Features,
    /// Oldest wire version to accept.
    pub min_version: u8,
    /// Newest wire version to offer.
    pub max_version: u8,
    /// The cluster key.
    pub psk: PreSharedKey,
    /// Time allowed from start to completion.
    pub timeout: Duration,
    /// Client only: the node we mean to reach; a welcome from any other node fails.
    pub expected_peer: Option<NodeId>,
}

/// What a completed handshake learned about the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerInfo {
    /// The peer node.
    pub node_id: NodeId,
    /// The peer's incarnation.
    pub incarnation: Incarnation,
    /// The peer's shard count.
    pub shard_count: u16,
    /// Features both sides have.
    pub features: Features,
    /// The negotiated wire version.
    pub version: u8,
}

/// Which side of the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Sends the hello.
    Client,
    /// Answers a hello.
    Server,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HsState {
    ClientAwaitWelcome,
    ServerAwaitHello,
    ServerAwaitConfirm,
    Done,
    Failed,
}

/// One handshake attempt, for either side. See the module docs for the calling order.
#[derive(Clone, Debug)]
pub struct Handshake {
    role: Role,
    cfg: HandshakeConfig,
    state: HsState,
    deadline: Timestamp,
    nonce: Nonce,
    hello: Option<[u8; HELLO_LEN]>,
    welcome: Option<[u8; WELCOME_LEN]>,
    peer: Option<PeerInfo>,
    outgoing: VecDeque<HandshakeMessage>,
    outcome: Option<Result<PeerInfo, HandshakeError>>,
    secret: Option<SessionSecret>,
    ignored: u64,
}

/// The client side of a join: one [`Join`] sent, waiting for a [`Joined`] (or a [`Reject`])
/// until the handshake deadline. Driven like [`Handshake`]: [`JoinAttempt::handle_message`],
/// [`JoinAttempt::handle_timeout`] at [`JoinAttempt::poll_timeout`], then
/// [`JoinAttempt::poll_transmit`] and [`JoinAttempt::outcome`]. Its outcome on success is the
/// session's [`PeerInfo`].
#[derive(Clone, Debug)]
pub struct JoinAttempt {
    session: PeerInfo,
    secret: SessionSecret,
    deadline: Timestamp,
    join: Join,
    outgoing: Option<Join>,
    outcome: Option<Result<PeerInfo, HandshakeError>>,
    ignored: u64,
}

/// Derives handshake nonces from a caller-supplied secret seed: nonce `i` is
/// `SHA-256("shardcx-nonce\0" ‖ seed ‖ i as u64 LE)`. The seed should come from the operating
/// system's random source; nonces are then unique and unpredictable without it. (The crate reads
/// no OS randomness itself.)
#[derive(Clone)]
pub struct NonceGen {
    seed: [u8; 32],
    counter: u64,
}

impl Features {
    /// No features.
    pub const EMPTY: Features = Features(0);
    /// Checked remote memory access (put/get carried as messages).
    pub const CHECKED_RMA: Features = Features(1 << 0);
    /// Native UCX RMA ("trusted cluster" mode).
    pub const TRUSTED_RMA: Features = Features(1 << 1);
    /// Typed RPC.
    pub const RPC: Features = Features(1 << 2);
    /// CUDA device memory.
    pub const CUDA: Features = Features(1 << 3);
    /// Shard-addressed connections: the session's other rails join it with [`Join`] (see the
    /// module docs). The net layer joins rails only when the session negotiated this bit (both
    /// sides have it); otherwise the pair talks over the primary connection alone, and a server
    /// refuses joins to the session with [`RejectReason::UnknownSession`].
    pub const RAILS: Features = Features(1 << 4);

    /// Features from raw bits (unknown bits kept).
    pub const fn from_bits_retain(bits: u64) -> Features {
        Features(bits)
    }

    /// The raw bits.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// Whether all of `other` is present.
    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bits present in both.
    pub const fn intersection(self, other: Features) -> Features {
        Features(self.0 & other.0)
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

impl PreSharedKey {
    /// A key; at least [`MIN_PSK_LEN`] bytes.
    pub fn new(key: &[u8]) -> Result<PreSharedKey, HandshakeError> {
        if key.len() < MIN_PSK_LEN {
            return Err(HandshakeError::WeakKey {
                len: key.len(),
                min: MIN_PSK_LEN,
            });
        }
        Ok(PreSharedKey(Arc::from(key)))
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length (longer ones are hashed), so this cannot fail.
        <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for PreSharedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PreSharedKey(<{} bytes>)", self.0.len())
    }
}

impl SessionSecret {
    /// A secret from its bytes. Sessions get theirs from [`Handshake::session_secret`]; this is
    /// for tests and for a net layer that must move a secret through bytes.
    pub fn from_bytes(bytes: [u8; SESSION_SECRET_LEN]) -> SessionSecret {
        SessionSecret(bytes)
    }

    /// Derives the secret from a completed exchange's messages (see the module docs).
    fn derive(
        psk: &PreSharedKey,
        hello: &[u8; HELLO_LEN],
        welcome: &[u8; WELCOME_LEN],
        confirm: &[u8; CONFIRM_LEN],
    ) -> SessionSecret {
        let mut mac = psk.mac();
        mac.update(SESSION_LABEL);
        mac.update(hello);
        mac.update(welcome);
        mac.update(confirm);
        SessionSecret(mac.finalize().into_bytes().into())
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length, so this cannot fail.
        <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    /// The MAC of a join's proof: its signed part and the rail, as the client sees it (`src`
    /// its own shard, `dst` the server's).
    fn join_mac(&self, signed: &[u8], src: ShardId, dst: ShardId) -> HmacSha256 {
        let mut mac = self.mac();
        mac.update(JOIN_LABEL);
        mac.update(signed);
        mac.update(&src.get().to_le_bytes());
        mac.update(&dst.get().to_le_bytes());
        mac
    }

    /// The MAC of a joined's proof: the whole join and the echo.
    fn joined_mac(&self, join: &[u8; JOIN_LEN], echo: &Nonce) -> HmacSha256 {
        let mut mac = self.mac();
        mac.update(JOINED_LABEL);
        mac.update(join);
        mac.update(echo);
        mac
    }
}

impl fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionSecret(..)")
    }
}

impl RejectReason {
    /// The wire code.
    pub fn to_u8(self) -> u8 {
        match self {
            RejectReason::BadProof => 1,
            RejectReason::VersionMismatch => 2,
            RejectReason::BadShardCount => 3,
            RejectReason::WrongNode => 4,
            RejectReason::Busy => 5,
            RejectReason::Shutdown => 6,
            RejectReason::UnknownSession => 7,
            RejectReason::NoSuchRail => 8,
            RejectReason::Banned => 9,
            RejectReason::Other(code) => code,
        }
    }

    /// From a wire code; unknown codes become [`RejectReason::Other`].
    pub fn from_u8(code: u8) -> RejectReason {
        match code {
            1 => RejectReason::BadProof,
            2 => RejectReason::VersionMismatch,
            3 => RejectReason::BadShardCount,
            4 => RejectReason::WrongNode,
            5 => RejectReason::Busy,
            6 => RejectReason::Shutdown,
            7 => RejectReason::UnknownSession,
            8 => RejectReason::NoSuchRail,
            9 => RejectReason::Banned,
            other => RejectReason::Other(other),
        }
    }
}

impl Hello {
    /// Encodes into exactly [`HELLO_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0] = self.min_version;
        b[1] = self.max_version;
        b[2..4].copy_from_slice(&self.shard_count.to_le_bytes());
        b[8..16].copy_from_slice(&self.node_id.get().to_le_bytes());
        b[16..24].copy_from_slice(&self.incarnation.get().to_le_bytes());
        b[24..32].copy_from_slice(&self.features.bits().to_le_bytes());
        b[32..64].copy_from_slice(&self.nonce);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Hello, HandshakeError> {
        check_len(FrameKind::Hello, b, HELLO_LEN)?;
        check_zero(FrameKind::Hello, b, 4..8)?;
        Ok(Hello {
            min_version: b[0],
            max_version: b[1],
            shard_count: read_u16(b, 2),
            node_id: NodeId::new(read_u64(b, 8)),
            incarnation: Incarnation::new(read_u64(b, 16)),
            features: Features(read_u64(b, 24)),
            nonce: array32(&b[32..64]),
        })
    }
}

impl Welcome {
    /// Encodes into exactly [`WELCOME_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; WELCOME_LEN] {
        let mut b = [0u8; WELCOME_LEN];
        b[0] = self.version;
        b[2..4].copy_from_slice(&self.shard_count.to_le_bytes());
        b[8..16].copy_from_slice(&self.node_id.get().to_le_bytes());
        b[16..24].copy_from_slice(&self.incarnation.get().to_le_bytes());
        b[24..32].copy_from_slice(&self.features.bits().to_le_bytes());
        b[32..64].copy_from_slice(&self.nonce);
        b[64..96].copy_from_slice(&self.echo);
        b[96..128].copy_from_slice(&self.proof);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Welcome, HandshakeError> {
        check_len(FrameKind::Welcome, b, WELCOME_LEN)?;
        check_zero(FrameKind::Welcome, b, 1..2)?;
        check_zero(FrameKind::Welcome, b, 4..8)?;
        Ok(Welcome {
            version: b[0],
            shard_count: read_u16(b, 2),
            node_id: NodeId::new(read_u64(b, 8)),
            incarnation: Incarnation::new(read_u64(b, 16)),
            features: Features(read_u64(b, 24)),
            nonce: array32(&b[32..64]),
            echo: array32(&b[64..96]),
            proof: array32(&b[96..128]),
        })
    }
}

impl Confirm {
    /// Encodes into exactly [`CONFIRM_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; CONFIRM_LEN] {
        let mut b = [0u8; CONFIRM_LEN];
        b[..32].copy_from_slice(&self.echo);
        b[32..].copy_from_slice(&self.proof);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Confirm, HandshakeError> {
        check_len(FrameKind::Confirm, b, CONFIRM_LEN)?;
        Ok(Confirm {
            echo: array32(&b[..32]),
            proof: array32(&b[32..64]),
        })
    }
}

impl Reject {
    /// A rejection of `join` by a side speaking `min_version..=max_version`.
    pub fn of_join(join: &Join, reason: RejectReason, min_version: u8, max_version: u8) -> Reject {
        Reject {
            reason,
            min_version,
            max_version,
            echo: join.nonce,
        }
    }

    /// A rejection of `hello` by a side speaking `min_version..=max_version`.
    pub fn of_hello(
        hello: &Hello,
        reason: RejectReason,
        min_version: u8,
        max_version: u8,
    ) -> Reject {
        Reject {
            reason,
            min_version,
            max_version,
            echo: hello.nonce,
        }
    }

    /// Encodes into exactly [`REJECT_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; REJECT_LEN] {
        let mut b = [0u8; REJECT_LEN];
        b[0] = self.reason.to_u8();
        b[1] = self.min_version;
        b[2] = self.max_version;
        b[8..40].copy_from_slice(&self.echo);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Reject, HandshakeError> {
        check_len(FrameKind::Reject, b, REJECT_LEN)?;
        check_zero(FrameKind::Reject, b, 3..8)?;
        Ok(Reject {
            reason: RejectReason::from_u8(b[0]),
            min_version: b[1],
            max_version: b[2],
            echo: array32(&b[8..40]),
        })
    }
}

impl Join {
    /// Encodes into exactly [`JOIN_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; JOIN_LEN] {
        let mut b = [0u8; JOIN_LEN];
        b[0] = self.version;
        b[2..4].copy_from_slice(&self.shard_count.to_le_bytes());
        b[8..16].copy_from_slice(&self.node_id.get().to_le_bytes());
        b[16..24].copy_from_slice(&self.incarnation.get().to_le_bytes());
        b[24..32].copy_from_slice(&self.server_incarnation.get().to_le_bytes());
        b[32..64].copy_from_slice(&self.nonce);
        b[64..96].copy_from_slice(&self.proof);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Join, HandshakeError> {
        check_len(FrameKind::Join, b, JOIN_LEN)?;
        check_zero(FrameKind::Join, b, 1..2)?;
        check_zero(FrameKind::Join, b, 4..8)?;
        Ok(Join {
            version: b[0],
            shard_count: read_u16(b, 2),
            node_id: NodeId::new(read_u64(b, 8)),
            incarnation: Incarnation::new(read_u64(b, 16)),
            server_incarnation: Incarnation::new(read_u64(b, 24)),
            nonce: array32(&b[32..64]),
            proof: array32(&b[64..96]),
        })
    }
}

impl Joined {
    /// Encodes into exactly [`JOINED_LEN`] bytes.
    pub fn to_bytes(&self) -> [u8; JOINED_LEN] {
        let mut b = [0u8; JOINED_LEN];
        b[..32].copy_from_slice(&self.echo);
        b[32..].copy_from_slice(&self.proof);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Joined, HandshakeError> {
        check_len(FrameKind::Joined, b, JOINED_LEN)?;
        Ok(Joined {
            echo: array32(&b[..32]),
            proof: array32(&b[32..64]),
        })
    }
}

impl HandshakeMessage {
    /// The frame kind that carries this message.
    pub fn kind(&self) -> FrameKind {
        match self {
            HandshakeMessage::Hello(_) => FrameKind::Hello,
            HandshakeMessage::Welcome(_) => FrameKind::Welcome,
            HandshakeMessage::Confirm(_) => FrameKind::Confirm,
            HandshakeMessage::Reject(_) => FrameKind::Reject,
            HandshakeMessage::Join(_) => FrameKind::Join,
            HandshakeMessage::Joined(_) => FrameKind::Joined,
        }
    }

    /// The encoded length.
    pub fn encoded_len(&self) -> usize {
        match self {
            HandshakeMessage::Hello(_) => HELLO_LEN,
            HandshakeMessage::Welcome(_) => WELCOME_LEN,
            HandshakeMessage::Confirm(_) => CONFIRM_LEN,
            HandshakeMessage::Reject(_) => REJECT_LEN,
            HandshakeMessage::Join(_) => JOIN_LEN,
            HandshakeMessage::Joined(_) => JOINED_LEN,
        }
    }

    /// Encodes into `buf`; returns the length written.
    pub fn encode(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let len = self.encoded_len();
        let Some(out) = buf.get_mut(..len) else {
            return Err(WireError::BufferTooSmall {
                what: "handshake message",
                needed: len,
                got: buf.len(),
            });
        };
        match self {
            HandshakeMessage::Hello(m) => out.copy_from_slice(&m.to_bytes()),
            HandshakeMessage::Welcome(m) => out.copy_from_slice(&m.to_bytes()),
            HandshakeMessage::Confirm(m) => out.copy_from_slice(&m.to_bytes()),
            HandshakeMessage::Reject(m) => out.copy_from_slice(&m.to_bytes()),
            HandshakeMessage::Join(m) => out.copy_from_slice(&m.to_bytes()),
            HandshakeMessage::Joined(m) => out.copy_from_slice(&m.to_bytes()),
        }
        Ok(len)
    }

    /// Decodes the payload of a frame of `kind`. Structural checks only (length, reserved
    /// fields); semantic checks (versions, shard count, proofs) belong to [`Handshake`].
    pub fn decode(kind: FrameKind, payload: &[u8]) -> Result<HandshakeMessage, HandshakeError> {
        match kind {
            FrameKind::Hello => Hello::from_bytes(payload).map(HandshakeMessage::Hello),
            FrameKind::Welcome => Welcome::from_bytes(payload).map(HandshakeMessage::Welcome),
            FrameKind::Confirm => Confirm::from_bytes(payload).map(HandshakeMessage::Confirm),
            FrameKind::Reject => Reject::from_bytes(payload).map(HandshakeMessage::Reject),
            FrameKind::Join => Join::from_bytes(payload).map(HandshakeMessage::Join),
            FrameKind::Joined => Joined::from_bytes(payload).map(HandshakeMessage::Joined),
            other => Err(HandshakeError::NotHandshake { kind: other }),
        }
    }

    /// The nonce of a message that opens an attempt ([`Hello`] or [`Join`]): what a [`Reject`]
    /// of it echoes. `None` for the other messages.
    pub fn opening_nonce(&self) -> Option<Nonce> {
        match self {
            HandshakeMessage::Hello(h) => Some(h.nonce),
            HandshakeMessage::Join(j) => Some(j.nonce),
            _ => None,
        }
    }
}

impl Handshake {
    /// Starts a client attempt at `now` with a fresh `nonce`; a [`Hello`] is queued for
    /// [`Handshake::poll_transmit`].
    pub fn client(now: Timestamp, cfg: HandshakeConfig, nonce: Nonce) -> Handshake {
        let hello = Hello {
            min_version: cfg.min_version,
            max_version: cfg.max_version,
            shard_count: cfg.shard_count,
            node_id: cfg.node_id,
            incarnation: cfg.incarnation,
            features: cfg.features,
            nonce,
        };
        let mut hs = Handshake::new(Role::Client, now, cfg, nonce, HsState::ClientAwaitWelcome);
        hs.hello = Some(hello.to_bytes());
        hs.outgoing.push_back(HandshakeMessage::Hello(hello));
        hs
    }

    /// Starts a server attempt at `now` with a fresh `nonce`, waiting for a [`Hello`].
    pub fn server(now: Timestamp, cfg: HandshakeConfig, nonce: Nonce) -> Handshake {
        Handshake::new(Role::Server, now, cfg, nonce, HsState::ServerAwaitHello)
    }

    fn new(
        role: Role,
        now: Timestamp,
        cfg: HandshakeConfig,
        nonce: Nonce,
        state: HsState,
    ) -> Handshake {
        let deadline = now.saturating_add(cfg.timeout);
        Handshake {
            role,
            cfg,
            state,
            deadline,
            nonce,
            hello: None,
            welcome: None,
            peer: None,
            outgoing: VecDeque::new(),
            outcome: None,
            secret: None,
            ignored: 0,
        }
    }

    /// This side's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// This attempt's nonce.
    pub fn nonce(&self) -> &Nonce {
        &self.nonce
    }

    /// The client nonce this attempt is answering (server) or sent (client), once known.
    pub fn client_nonce(&self) -> Option<Nonce> {
        self.hello.map(|h| array32(&h[32..64]))
    }

    /// Messages ignored as stale or out of place.
    pub fn ignored(&self) -> u64 {
        self.ignored
    }

    /// The result, once the handshake has finished.
    pub fn outcome(&self) -> Option<&Result<PeerInfo, HandshakeError>> {
        self.outcome.as_ref()
    }

    /// Whether the handshake has finished (either way).
    pub fn is_finished(&self) -> bool {
        self.outcome.is_some()
    }

    /// The session secret, once the handshake has succeeded (the same on both sides).
    pub fn session_secret(&self) -> Option<&SessionSecret> {
        self.secret.as_ref()
    }

    /// The next message to send, if any.
    pub fn poll_transmit(&mut self) -> Option<HandshakeMessage> {
        self.outgoing.pop_front()
    }

    /// The handshake deadline while it is in progress.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        (!self.is_finished()).then_some(self.deadline)
    }

    /// Fails the attempt with [`HandshakeError::Timeout`] if `now` is at or past the deadline.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        if !self.is_finished() && now >= self.deadline {
            self.fail(HandshakeError::Timeout);
        }
    }

    /// Processes a received handshake message.
    pub fn handle_message(&mut self, now: Timestamp, msg: &HandshakeMessage) {
        if self.is_finished() {
            self.ignored += 1;
            return;
        }
        if now >= self.deadline {
            self.fail(HandshakeError::Timeout);
            return;
        }
        match (self.state, msg) {
            (HsState::ServerAwaitHello, HandshakeMessage::Hello(h)) => self.on_hello(h),
            (HsState::ClientAwaitWelcome, HandshakeMessage::Welcome(w)) => self.on_welcome(w),
            (HsState::ServerAwaitConfirm, HandshakeMessage::Confirm(c)) => self.on_confirm(c),
            (
                HsState::ClientAwaitWelcome | HsState::ServerAwaitConfirm,
                HandshakeMessage::Reject(r),
            ) => {
                if r.echo == self.nonce {
                    self.fail(HandshakeError::Rejected { reason: r.reason });
                } else {
                    self.ignored += 1;
                }
            }
            _ => self.ignored += 1,
        }
    }

    fn on_hello(&mut self, h: &Hello) {
        let (min, max) = (self.cfg.min_version, self.cfg.max_version);
        if h.shard_count == 0 || h.shard_count > MAX_SHARDS {
            self.reject_hello(h, RejectReason::BadShardCount);
            self.fail(HandshakeError::BadShardCount {
                shard_count: h.shard_count,
            });
            return;
        }
        let chosen = h.max_version.min(max);
        if h.min_version > h.max_version || chosen < h.min_version.max(min) {
            self.reject_hello(h, RejectReason::VersionMismatch);
            self.fail(HandshakeError::VersionMismatch {
                ours_min: min,
                ours_max: max,
                theirs_min: h.min_version,
                theirs_max: h.max_version,
            });
            return;
        }
        let hello_bytes = h.to_bytes();
        let mut welcome = Welcome {
            version: chosen,
            shard_count: self.cfg.shard_count,
            node_id: self.cfg.node_id,
            incarnation: self.cfg.incarnation,
            features: self.cfg.features,
            nonce: self.nonce,
            echo: h.nonce,
            proof: [0; PROOF_LEN],
        };
        let unsigned = welcome.to_bytes();
        let mut mac = self.cfg.psk.mac();
        mac.update(WELCOME_LABEL);
        mac.update(&hello_bytes);
        mac.update(&unsigned[..96]);
        welcome.proof = mac.finalize().into_bytes().into();
        self.hello = Some(hello_bytes);
        self.welcome = Some(welcome.to_bytes());
        self.peer = Some(PeerInfo {
            node_id: h.node_id,
            incarnation: h.incarnation,
            shard_count: h.shard_count,
            features: h.features.intersection(self.cfg.features),
            version: chosen,
        });
        self.outgoing.push_back(HandshakeMessage::Welcome(welcome));
        self.state = HsState::ServerAwaitConfirm;
    }

    fn on_welcome(&mut self, w: &Welcome) {
        let Some(hello_bytes) = self.hello else {
            self.ignored += 1;
            return;
        };
        if w.echo != self.nonce {
            self.ignored += 1;
            return;
        }
        let wb = w.to_bytes();
        let mut mac = self.cfg.psk.mac();
        mac.update(WELCOME_LABEL);
        mac.update(&hello_bytes);
        mac.update(&wb[..96]);
        if mac.verify_slice(&w.proof).is_err() {
            self.reject_peer(w.nonce, RejectReason::BadProof);
            self.fail(HandshakeError::BadProof);
            return;
        }
        if let Some(expected) = self.cfg.expected_peer {
            if expected != w.node_id {
                self.reject_peer(w.nonce, RejectReason::WrongNode);
                self.fail(HandshakeError::WrongPeer {
                    expected,
                    got: w.node_id,
                });
                return;
            }
        }
        if !(self.cfg.min_version..=self.cfg.max_version).contains(&w.version) {
            self.reject_peer(w.nonce, RejectReason::VersionMismatch);
            self.fail(HandshakeError::VersionMismatch {
                ours_min: self.cfg.min_version,
                ours_max: self.cfg.max_version,
                theirs_min: w.version,
                theirs_max: w.version,
            });
            return;
        }
        if w.shard_count == 0 || w.shard_count > MAX_SHARDS {
            self.reject_peer(w.nonce, RejectReason::BadShardCount);
            self.fail(HandshakeError::BadShardCount {
                shard_count: w.shard_count,
            });
            return;
        }
        let mut confirm = Confirm {
            echo: w.nonce,
            proof: [0; PROOF_LEN],
        };
        let mut mac = self.cfg.psk.mac();
        mac.update(CONFIRM_LABEL);
        mac.update(&hello_bytes);
        mac.update(&wb);
        mac.update(&confirm.echo);
        confirm.proof = mac.finalize().into_bytes().into();
        self.secret = Some(SessionSecret::derive(
            &self.cfg.psk,
            &hello_bytes,
            &wb,
            &confirm.to_bytes(),
        ));
        self.outgoing.push_back(HandshakeMessage::Confirm(confirm));
        self.succeed(PeerInfo {
            node_id: w.node_id,
            incarnation: w.incarnation,
            shard_count: w.shard_count,
            features: w.features.intersection(self.cfg.features),
            version: w.version,
        });
    }

    fn on_confirm(&mut self, c: &Confirm) {
        let (Some(hello_bytes), Some(wb), Some(peer)) = (self.hello, self.welcome, self.peer)
        else {
            self.ignored += 1;
            return;
        };
        if c.echo != self.nonce {
            self.ignored += 1;
            return;
        }
        let mut mac = self.cfg.psk.mac();
        mac.update(CONFIRM_LABEL);
        mac.update(&hello_bytes);
        mac.update(&wb);
        mac.update(&c.echo);
        if mac.verify_slice(&c.proof).is_err() {
            self.reject_peer(array32(&hello_bytes[32..64]), RejectReason::BadProof);
            self.fail(HandshakeError::BadProof);
            return;
        }
        self.secret = Some(SessionSecret::derive(
            &self.cfg.psk,
            &hello_bytes,
            &wb,
            &c.to_bytes(),
        ));
        self.succeed(peer);
    }

    fn reject_hello(&mut self, h: &Hello, reason: RejectReason) {
        self.reject_peer(h.nonce, reason);
    }

    fn reject_peer(&mut self, their_nonce: Nonce, reason: RejectReason) {
        self.outgoing.push_back(HandshakeMessage::Reject(Reject {
            reason,
            min_version: self.cfg.min_version,
            max_version: self.cfg.max_version,
            echo: their_nonce,
        }));
    }

    fn succeed(&mut self, peer: PeerInfo) {
        self.state = HsState::Done;
        self.outcome = Some(Ok(peer));
    }

    fn fail(&mut self, err: HandshakeError) {
        self.state = HsState::Failed;
        self.outcome = Some(Err(err));
    }
}

impl JoinAttempt {
    /// Starts a join at `now` of the rail `rail` (this side's view: `local` is this shard,
    /// `remote` the server's) to the session with `session` (the server as learned in the
    /// session's handshake) keyed by `secret`, with a fresh `nonce`; the [`Join`] is queued for
    /// [`JoinAttempt::poll_transmit`]. If `rail` is not a rail of the pair (from
    /// `cfg.shard_count` and `session.shard_count`), the attempt has already failed with
    /// [`HandshakeError::NoSuchRail`] and sends nothing.
    pub fn new(
        now: Timestamp,
        cfg: &HandshakeConfig,
        session: PeerInfo,
        secret: SessionSecret,
        rail: Rail,
        nonce: Nonce,
    ) -> JoinAttempt {
        let mut join = Join {
            version: session.version,
            shard_count: cfg.shard_count,
            node_id: cfg.node_id,
            incarnation: cfg.incarnation,
            server_incarnation: session.incarnation,
            nonce,
            proof: [0; PROOF_LEN],
        };
        let signed = join.to_bytes();
        join.proof = secret
            .join_mac(&signed[..JOIN_SIGNED_LEN], rail.local, rail.remote)
            .finalize()
            .into_bytes()
            .into();
        let on_rail = Rails::new(cfg.shard_count, session.shard_count)
            .is_ok_and(|r| r.has_rail(rail.local, rail.remote));
        JoinAttempt {
            session,
            secret,
            deadline: now.saturating_add(cfg.timeout),
            join,
            outgoing: on_rail.then_some(join),
            outcome: (!on_rail).then_some(Err(HandshakeError::NoSuchRail {
                local: rail.local,
                remote: rail.remote,
            })),
            ignored: 0,
        }
    }

    /// This attempt's nonce.
    pub fn nonce(&self) -> &Nonce {
        &self.join.nonce
    }

    /// The join this attempt sends.
    pub fn join(&self) -> &Join {
        &self.join
    }

    /// Messages ignored as stale or out of place.
    pub fn ignored(&self) -> u64 {
        self.ignored
    }

    /// The result, once the join has finished: the session's [`PeerInfo`] on success.
    pub fn outcome(&self) -> Option<&Result<PeerInfo, HandshakeError>> {
        self.outcome.as_ref()
    }

    /// Whether the join has finished (either way).
    pub fn is_finished(&self) -> bool {
        self.outcome.is_some()
    }

    /// The next message to send (the join, once).
    pub fn poll_transmit(&mut self) -> Option<HandshakeMessage> {
        self.outgoing.take().map(HandshakeMessage::Join)
    }

    /// The deadline while the join is in progress.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        (!self.is_finished()).then_some(self.deadline)
    }

    /// Fails the attempt with [`HandshakeError::Timeout`] if `now` is at or past the deadline.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        if !self.is_finished() && now >= self.deadline {
            self.outcome = Some(Err(HandshakeError::Timeout));
        }
    }

    /// Processes a received handshake message: a [`Joined`] or a [`Reject`] echoing this
    /// attempt's nonce ends it; anything else is ignored.
    pub fn handle_message(&mut self, now: Timestamp, msg: &HandshakeMessage) {
        if self.is_finished() {
            self.ignored += 1;
            return;
        }
        if now >= self.deadline {
            self.outcome = Some(Err(HandshakeError::Timeout));
            return;
        }
        match msg {
            HandshakeMessage::Joined(j) if j.echo == self.join.nonce => {
                let mac = self.secret.joined_mac(&self.join.to_bytes(), &j.echo);
                self.outcome = Some(if mac.verify_slice(&j.proof).is_ok() {
                    Ok(self.session)
                } else {
                    // No reject is sent: the server already considers the rail joined, and a
                    // reject echoes a nonce the server does not have. The caller's failure
                    // handling closes the rail.
                    Err(HandshakeError::BadProof)
                });
            }
            HandshakeMessage::Reject(r) if r.echo == self.join.nonce => {
                self.outcome = Some(Err(HandshakeError::Rejected { reason: r.reason }));
            }
            _ => self.ignored += 1,
        }
    }
}

/// The server side of a join: checks `join`, received on `rail` (this side's view: `local` is
/// this shard, `remote` the frame's `src_shard`), against the session with `session` (the
/// client as learned in the session's handshake) keyed by `secret`, and returns the
/// [`Joined`] to send. `cfg` is this node's. The checks and their order are in the module docs;
/// the error's [`HandshakeError::reject_reason`] is the reason to answer with.
pub fn accept_join(
    cfg: &HandshakeConfig,
    session: &PeerInfo,
    secret: &SessionSecret,
    rail: Rail,
    join: &Join,
) -> Result<Joined, HandshakeError> {
    let same_session = join.node_id == session.node_id
        && join.incarnation == session.incarnation
        && join.server_incarnation == cfg.incarnation
        && join.shard_count == session.shard_count
        && join.version == session.version
        && session.features.contains(Features::RAILS);
    if !same_session {
        return Err(HandshakeError::UnknownSession);
    }
    let on_rail = Rails::new(cfg.shard_count, session.shard_count)
        .is_ok_and(|r| r.has_rail(rail.local, rail.remote));
    if !on_rail {
        return Err(HandshakeError::NoSuchRail {
            local: rail.local,
            remote: rail.remote,
        });
    }
    let bytes = join.to_bytes();
    // The client's view of the rail: its shard (our remote) to ours.
    let mac = secret.join_mac(&bytes[..JOIN_SIGNED_LEN], rail.remote, rail.local);
    if mac.verify_slice(&join.proof).is_err() {
        return Err(HandshakeError::BadProof);
    }
    Ok(Joined {
        echo: join.nonce,
        proof: secret
            .joined_mac(&bytes, &join.nonce)
            .finalize()
            .into_bytes()
            .into(),
    })
}

impl HandshakeError {
    /// The reason a [`Reject`] for this error carries, for the errors a server answers that way
    /// (bad proof, version mismatch, bad shard count, wrong node, unknown session, no such
    /// rail); `None` for the others.
    pub fn reject_reason(&self) -> Option<RejectReason> {
        match self {
            HandshakeError::BadProof => Some(RejectReason::BadProof),
            HandshakeError::VersionMismatch { .. } => Some(RejectReason::VersionMismatch),
            HandshakeError::BadShardCount { .. } => Some(RejectReason::BadShardCount),
            HandshakeError::WrongPeer { .. } => Some(RejectReason::WrongNode),
            HandshakeError::UnknownSession => Some(RejectReason::UnknownSession),
            HandshakeError::NoSuchRail { .. } => Some(RejectReason::NoSuchRail),
            _ => None,
        }
    }
}

impl NonceGen {
    /// A generator from a secret random seed.
    pub fn new(seed: [u8; 32]) -> NonceGen {
        NonceGen { seed, counter: 0 }
    }

    /// The next nonce.
    pub fn next_nonce(&mut self) -> Nonce {
        let mut h = Sha256::new();
        h.update(NONCE_LABEL);
        h.update(self.seed);
        h.update(self.counter.to_le_bytes());
        self.counter = self.counter.wrapping_add(1);
        h.finalize().into()
    }
}

impl fmt::Debug for NonceGen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NonceGen")
            .field("counter", &self.counter)
            .finish_non_exhaustive()
    }
}

impl HandshakeConfig {
    /// A configuration speaking every wire version this build knows, with a 5 s timeout and
    /// [`Features::RAILS`] alone.
    pub fn new(
        node_id: NodeId,
        incarnation: Incarnation,
        shard_count: u16,
        psk: PreSharedKey,
    ) -> HandshakeConfig {
        HandshakeConfig {
            node_id,
            incarnation,
            shard_count,
            features: Features::RAILS,
            min_version: MIN_WIRE_VERSION,
            max_version: MAX_WIRE_VERSION,
            psk,
            timeout: Duration::from_secs(5),
            expected_peer: None,
        }
    }
}

fn check_len(kind: FrameKind, b: &[u8], expected: usize) -> Result<(), HandshakeError> {
    if b.len() == expected {
        Ok(())
    } else {
        Err(HandshakeError::BadLength {
            kind,
            expected,
            got: b.len(),
        })
    }
}

fn check_zero(
    kind: FrameKind,
    b: &[u8],
    range: std::ops::Range<usize>,
) -> Result<(), HandshakeError> {
    let offset = range.start;
    if b[range].iter().all(|&x| x == 0) {
        Ok(())
    } else {
        Err(HandshakeError::ReservedNonZero { kind, offset })
    }
}

fn array32(b: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(b);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    fn psk(b: u8) -> PreSharedKey {
        PreSharedKey::new(&[b; 32]).unwrap()
    }

    fn cfg(node: u64, key: u8) -> HandshakeConfig {
        HandshakeConfig::new(NodeId::new(node), Incarnation::new(node * 10), 4, psk(key))
    }

    /// Runs messages between two handshakes until both are quiet.
    fn pump(now: Timestamp, a: &mut Handshake, b: &mut Handshake) {
        loop {
            let mut moved = false;
            while let Some(m) = a.poll_transmit() {
                b.handle_message(now, &round_trip(&m));
                moved = true;
            }
            while let Some(m) = b.poll_transmit() {
                a.handle_message(now, &round_trip(&m));
                moved = true;
            }
            if !moved {
                break;
            }
        }
    }

    fn round_trip(m: &HandshakeMessage) -> HandshakeMessage {
        let mut buf = [0u8; MAX_HANDSHAKE_LEN];
        let n = m.encode(&mut buf).unwrap();
        HandshakeMessage::decode(m.kind(), &buf[..n]).unwrap()
    }

    #[test]
    fn success_both_sides() {
        let now = Timestamp::ZERO;
        let mut c_cfg = cfg(1, 7);
        c_cfg.features = Features::RPC | Features::CHECKED_RMA;
        c_cfg.expected_peer = Some(NodeId::new(2));
        let mut s_cfg = cfg(2, 7);
        s_cfg.features = Features::RPC | Features::CUDA;
        let mut c = Handshake::client(now, c_cfg, [1; 32]);
        let mut s = Handshake::server(now, s_cfg, [2; 32]);
        pump(now, &mut c, &mut s);
        let cp = c.outcome().unwrap().clone().unwrap();
        let sp = s.outcome().unwrap().clone().unwrap();
        assert_eq!(cp.node_id, NodeId::new(2));
        assert_eq!(cp.incarnation, Incarnation::new(20));
        assert_eq!(sp.node_id, NodeId::new(1));
        assert_eq!(cp.features, Features::RPC);
        assert_eq!(sp.features, Features::RPC);
        assert_eq!(cp.version, MAX_WIRE_VERSION);
        assert_eq!(c.poll_timeout(), None);
        assert_eq!(s.client_nonce(), Some([1; 32]));
    }

    #[test]
    fn wrong_key_is_rejected_with_reason() {
        let now = Timestamp::ZERO;
        let mut c = Handshake::client(now, cfg(1, 7), [1; 32]);
        let mut s = Handshake::server(now, cfg(2, 8), [2; 32]);
        pump(now, &mut c, &mut s);
        assert_eq!(c.outcome(), Some(&Err(HandshakeError::BadProof)));
        assert_eq!(
            s.outcome(),
            Some(&Err(HandshakeError::Rejected {
                reason: RejectReason::BadProof
            }))
        );
    }

    #[test]
    fn forged_confirm_is_rejected() {
        let now = Timestamp::ZERO;
        let mut c = Handshake::client(now, cfg(1, 7), [1; 32]);
        let mut s = Handshake::server(now, cfg(2, 7), [2; 32]);
        let hello = c.poll_transmit().unwrap();
        s.handle_message(now, &hello);
        let Some(HandshakeMessage::Welcome(w)) = s.poll_transmit() else {
            panic!("expected welcome");
        };
        s.handle_message(
            now,
            &HandshakeMessage::Confirm(Confirm {
                echo: w.nonce,
                proof: [0; 32],
            }),
        );
        assert_eq!(s.outcome(), Some(&Err(HandshakeError::BadProof)));
        assert!(matches!(
            s.poll_transmit(),
            Some(HandshakeMessage::Reject(Reject { reason: RejectReason::BadProof, echo, .. })) if echo == [1; 32]
        ));
    }

    #[test]
    fn version_negotiation() {
        let now = Timestamp::ZERO;
        let mut c_cfg = cfg(1, 7);
        c_cfg.min_version = 2;
        c_cfg.max_version = 5;
        let mut c = Handshake::client(now, c_cfg, [1; 32]);
        let mut s = Handshake::server(now, cfg(2, 7), [2; 32]);
        pump(now, &mut c, &mut s);
        assert!(matches!(
            s.outcome(),
            Some(Err(HandshakeError::VersionMismatch {
                theirs_min: 2,
                theirs_max: 5,
                ..
            }))
        ));
        assert_eq!(
            c.outcome(),
            Some(&Err(HandshakeError::Rejected {
                reason: RejectReason::VersionMismatch
            }))
        );
    }

    #[test]
    fn highest_common_version_is_chosen() {
        let now = Timestamp::ZERO;
        let mut c_cfg = cfg(1, 7);
        c_cfg.min_version = 1;
        c_cfg.max_version = 3;
        let mut s_cfg = cfg(2, 7);
        s_cfg.min_version = 1;
        s_cfg.max_version = 2;
        let mut c = Handshake::client(now, c_cfg, [1; 32]);
        let mut s = Handshake::server(now, s_cfg, [2; 32]);
        pump(now, &mut c, &mut s);
        assert_eq!(c.outcome().unwrap().as_ref().unwrap().version, 2);
        assert_eq!(s.outcome().unwrap().as_ref().unwrap().version, 2);
    }

    #[test]
    fn bad_shard_count_and_wrong_peer() {
        let now = Timestamp::ZERO;
        let mut c_cfg = cfg(1, 7);
        c_cfg.shard_count = 0;
        let mut c = Handshake::client(now, c_cfg, [1; 32]);
        let mut s = Handshake::server(now, cfg(2, 7), [2; 32]);
        pump(now, &mut c, &mut s);
        assert_eq!(
            c.outcome(),
            Some(&Err(HandshakeError::Rejected {
                reason: RejectReason::BadShardCount
            }))
        );
        let mut c_cfg = cfg(1, 7);
        c_cfg.expected_peer = Some(NodeId::new(3));
        let mut c = Handshake::client(now, c_cfg, [1; 32]);
        let mut s = Handshake::server(now, cfg(2, 7), [2; 32]);
        pump(now, &mut c, &mut s);
        assert!(matches!(
            c.outcome(),
            Some(Err(HandshakeError::WrongPeer { .. }))
        ));
        assert_eq!(
            s.outcome(),
            Some(&Err(HandshakeError::Rejected {
                reason: RejectReason::WrongNode
            }))
        );
    }

    #[test]
    fn stale_messages_are_ignored_and_deadline_fires() {
        let now = Timestamp::ZERO;
        let mut c = Handshake::client(now, cfg(1, 7), [1; 32]);
        let _ = c.poll_transmit();
        // A reject for another attempt.
        c.handle_message(
            now,
            &HandshakeMessage::Reject(Reject {
                reason: RejectReason::Busy,
                min_version: 1,
                max_version: 1,
                echo: [9; 32],
            }),
        );
        assert!(!c.is_finished());
        assert_eq!(c.ignored(), 1);
        let deadline = c.poll_timeout().unwrap();
        assert_eq!(deadline, now + Duration::from_secs(5));
        c.handle_timeout(Timestamp::from_nanos(deadline.as_nanos() - 1));
        assert!(!c.is_finished());
        c.handle_timeout(deadline);
        assert_eq!(c.outcome(), Some(&Err(HandshakeError::Timeout)));
    }

    #[test]
    fn decode_rejects_bad_payloads() {
        assert!(matches!(
            HandshakeMessage::decode(FrameKind::Hello, &[0; 63]),
            Err(HandshakeError::BadLength {
                expected: 64,
                got: 63,
                ..
            })
        ));
        let mut b = [0u8; HELLO_LEN];
        b[5] = 1;
        assert_eq!(
            HandshakeMessage::decode(FrameKind::Hello, &b),
            Err(HandshakeError::ReservedNonZero {
                kind: FrameKind::Hello,
                offset: 4
            })
        );
        assert!(matches!(
            HandshakeMessage::decode(FrameKind::Am, &b),
            Err(HandshakeError::NotHandshake { .. })
        ));
        let mut r = [0u8; REJECT_LEN];
        r[0] = 200;
        assert!(matches!(
            HandshakeMessage::decode(FrameKind::Reject, &r),
            Ok(HandshakeMessage::Reject(Reject {
                reason: RejectReason::Other(200),
                ..
            }))
        ));
        assert!(PreSharedKey::new(&[0; 15]).is_err());
        assert_eq!(format!("{:?}", psk(1)), "PreSharedKey(<32 bytes>)");
    }

    /// A completed exchange between node 1 (client, 2 shards) and node 2 (server, 3 shards):
    /// (client's session: the server; server's session: the client; the secret).
    fn session() -> (PeerInfo, PeerInfo, SessionSecret) {
        let now = Timestamp::ZERO;
        let mut c_cfg = cfg(1, 7);
        c_cfg.shard_count = 2;
        let mut s_cfg = cfg(2, 7);
        s_cfg.shard_count = 3;
        let mut c = Handshake::client(now, c_cfg, [1; 32]);
        let mut s = Handshake::server(now, s_cfg, [2; 32]);
        pump(now, &mut c, &mut s);
        let secret = c.session_secret().unwrap().clone();
        assert_eq!(s.session_secret(), Some(&secret));
        let cp = *c.outcome().unwrap().as_ref().unwrap();
        let sp = *s.outcome().unwrap().as_ref().unwrap();
        (cp, sp, secret)
    }

    fn rail(local: u16, remote: u16) -> Rail {
        Rail {
            local: ShardId::new(local),
            remote: ShardId::new(remote),
        }
    }

    fn server_cfg() -> HandshakeConfig {
        let mut s_cfg = cfg(2, 7);
        s_cfg.shard_count = 3;
        s_cfg
    }

    fn client_cfg() -> HandshakeConfig {
        let mut c_cfg = cfg(1, 7);
        c_cfg.shard_count = 2;
        c_cfg
    }

    #[test]
    fn session_secret_is_shared_and_fresh() {
        let now = Timestamp::ZERO;
        let (_, _, secret) = session();
        // Another exchange (other nonces) makes another secret.
        let mut c = Handshake::client(now, cfg(1, 7), [3; 32]);
        let mut s = Handshake::server(now, cfg(2, 7), [2; 32]);
        assert_eq!(c.session_secret(), None, "none before completion");
        pump(now, &mut c, &mut s);
        assert_eq!(c.session_secret(), s.session_secret());
        assert_ne!(c.session_secret(), Some(&secret));
        // A failed exchange has none.
        let mut c = Handshake::client(now, cfg(1, 7), [1; 32]);
        let mut s = Handshake::server(now, cfg(2, 8), [2; 32]);
        pump(now, &mut c, &mut s);
        assert_eq!((c.session_secret(), s.session_secret()), (None, None));
        assert_eq!(format!("{secret:?}"), "SessionSecret(..)");
        assert!(
            HandshakeConfig::new(NodeId::new(1), Incarnation::new(1), 1, psk(1))
                .features
                .contains(Features::RAILS)
        );
    }

    #[test]
    fn join_is_accepted_and_verified() {
        let now = Timestamp::ZERO;
        let (server, client, secret) = session();
        assert!(server.features.contains(Features::RAILS));
        // Client shard 0 joins server shard 2: rails of 2 x 3 are (0,0), (1,1), (0,2).
        let mut j = JoinAttempt::new(
            now,
            &client_cfg(),
            server,
            secret.clone(),
            rail(0, 2),
            [5; 32],
        );
        assert_eq!(j.poll_timeout(), Some(now + Duration::from_secs(5)));
        let msg = round_trip(&j.poll_transmit().unwrap());
        assert_eq!(j.poll_transmit(), None, "sent once");
        let HandshakeMessage::Join(join) = msg else {
            panic!("expected a join")
        };
        assert_eq!(&join, j.join());
        assert_eq!(join.server_incarnation, Incarnation::new(20));
        assert_eq!(join.version, server.version);
        let joined = accept_join(&server_cfg(), &client, &secret, rail(2, 0), &join).unwrap();
        // A joined for another nonce is ignored; the right one completes.
        j.handle_message(
            now,
            &HandshakeMessage::Joined(Joined {
                echo: [6; 32],
                ..joined
            }),
        );
        assert_eq!((j.is_finished(), j.ignored()), (false, 1));
        j.handle_message(now, &round_trip(&HandshakeMessage::Joined(joined)));
        assert_eq!(j.outcome(), Some(&Ok(server)));
        assert_eq!(j.poll_timeout(), None);
        j.handle_message(now, &HandshakeMessage::Joined(joined));
        assert_eq!(j.ignored(), 2, "finished attempts ignore input");
    }

    #[test]
    fn join_refusals_in_order() {
        let now = Timestamp::ZERO;
        let (server, client, secret) = session();
        let s_cfg = server_cfg();
        let join = |rail_c: Rail, secret: &SessionSecret, server: PeerInfo| {
            let mut j =
                JoinAttempt::new(now, &client_cfg(), server, secret.clone(), rail_c, [5; 32]);
            match j.poll_transmit() {
                Some(HandshakeMessage::Join(join)) => join,
                other => panic!("{other:?}"),
            }
        };
        let good = join(rail(1, 1), &secret, server);
        assert!(accept_join(&s_cfg, &client, &secret, rail(1, 1), &good).is_ok());
        // Every field that names the session.
        let unknown = Err(HandshakeError::UnknownSession);
        for bad in [
            Join {
                node_id: NodeId::new(9),
                ..good
            },
            Join {
                incarnation: Incarnation::new(11),
                ..good
            },
            Join {
                server_incarnation: Incarnation::new(19),
                ..good
            },
            Join {
                shard_count: 4,
                ..good
            },
            Join { version: 9, ..good },
        ] {
            assert_eq!(
                accept_join(&s_cfg, &client, &secret, rail(1, 1), &bad),
                unknown
            );
        }
        // A restarted server (new incarnation) holds no session from its previous life.
        let restarted = HandshakeConfig {
            incarnation: Incarnation::new(21),
            ..s_cfg.clone()
        };
        assert_eq!(
            accept_join(&restarted, &client, &secret, rail(1, 1), &good),
            unknown
        );
        let no_rails = PeerInfo {
            features: Features::RPC,
            ..client
        };
        assert_eq!(
            accept_join(&s_cfg, &no_rails, &secret, rail(1, 1), &good),
            unknown
        );
        // (server 1, client 0) is no rail of 3 x 2: (0,0), (1,1), (2,0).
        assert_eq!(
            accept_join(&s_cfg, &client, &secret, rail(1, 0), &good),
            Err(HandshakeError::NoSuchRail {
                local: ShardId::new(1),
                remote: ShardId::new(0)
            })
        );
        // A join made for (client 1, server 1) replayed on the rail (server 0, client 0), or
        // made with another secret, does not verify.
        assert_eq!(
            accept_join(&s_cfg, &client, &secret, rail(0, 0), &good),
            Err(HandshakeError::BadProof)
        );
        let other = SessionSecret::from_bytes([0; 32]);
        let forged = join(rail(1, 1), &other, server);
        assert_eq!(
            accept_join(&s_cfg, &client, &secret, rail(1, 1), &forged),
            Err(HandshakeError::BadProof)
        );
        assert_eq!(
            HandshakeError::UnknownSession.reject_reason(),
            Some(RejectReason::UnknownSession)
        );
        assert_eq!(HandshakeError::Timeout.reject_reason(), None);
    }

    #[test]
    fn join_client_failures() {
        let now = Timestamp::ZERO;
        let (server, client, secret) = session();
        let c_cfg = client_cfg();
        // Not a rail: failed at once, nothing sent.
        let mut j = JoinAttempt::new(now, &c_cfg, server, secret.clone(), rail(1, 2), [5; 32]);
        assert_eq!(j.poll_transmit(), None);
        assert_eq!(
            j.outcome(),
            Some(&Err(HandshakeError::NoSuchRail {
                local: ShardId::new(1),
                remote: ShardId::new(2)
            }))
        );
        // A joined whose proof does not verify (the server holds another secret).
        let mut j = JoinAttempt::new(now, &c_cfg, server, secret.clone(), rail(1, 1), [5; 32]);
        let Some(HandshakeMessage::Join(join)) = j.poll_transmit() else {
            panic!("expected a join")
        };
        let mut joined = accept_join(&server_cfg(), &client, &secret, rail(1, 1), &join).unwrap();
        joined.proof[0] ^= 1;
        j.handle_message(now, &HandshakeMessage::Joined(joined));
        assert_eq!(j.outcome(), Some(&Err(HandshakeError::BadProof)));
        // A reject for this attempt; one for another is ignored.
        let mut j = JoinAttempt::new(now, &c_cfg, server, secret.clone(), rail(1, 1), [5; 32]);
        let reject = Reject::of_join(j.join(), RejectReason::UnknownSession, 1, 1);
        j.handle_message(
            now,
            &HandshakeMessage::Reject(Reject {
                echo: [0; 32],
                ..reject
            }),
        );
        j.handle_message(
            now,
            &HandshakeMessage::Confirm(Confirm {
                echo: [5; 32],
                proof: [0; 32],
            }),
        );
        assert_eq!(j.ignored(), 2);
        j.handle_message(now, &HandshakeMessage::Reject(reject));
        assert_eq!(
            j.outcome(),
            Some(&Err(HandshakeError::Rejected {
                reason: RejectReason::UnknownSession
            }))
        );
        // The deadline.
        let mut j = JoinAttempt::new(now, &c_cfg, server, secret, rail(1, 1), [5; 32]);
        let deadline = j.poll_timeout().unwrap();
        j.handle_timeout(Timestamp::from_nanos(deadline.as_nanos() - 1));
        assert!(!j.is_finished());
        j.handle_message(deadline, &HandshakeMessage::Joined(joined));
        assert_eq!(j.outcome(), Some(&Err(HandshakeError::Timeout)));
        assert_eq!(*j.nonce(), [5; 32]);
    }

    #[test]
    fn join_layout_and_decode_errors() {
        let join = Join {
            version: 1,
            shard_count: 0x0302,
            node_id: NodeId::new(0x0807_0605_0403_0201),
            incarnation: Incarnation::new(0x11),
            server_incarnation: Incarnation::new(0x22),
            nonce: [0xaa; 32],
            proof: [0xbb; 32],
        };
        let b = join.to_bytes();
        assert_eq!(&b[..8], &[1, 0, 2, 3, 0, 0, 0, 0]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!((b[16], b[24], b[32], b[64]), (0x11, 0x22, 0xaa, 0xbb));
        let msg = HandshakeMessage::Join(join);
        assert_eq!(round_trip(&msg), msg);
        assert_eq!(msg.opening_nonce(), Some([0xaa; 32]));
        for offset in [1, 4, 7] {
            let mut bad = b;
            bad[offset] = 1;
            assert_eq!(
                HandshakeMessage::decode(FrameKind::Join, &bad),
                Err(HandshakeError::ReservedNonZero {
                    kind: FrameKind::Join,
                    offset: if offset == 1 { 1 } else { 4 }
                })
            );
        }
        assert!(matches!(
            HandshakeMessage::decode(FrameKind::Join, &b[..95]),
            Err(HandshakeError::BadLength {
                expected: 96,
                got: 95,
                ..
            })
        ));
        assert!(matches!(
            HandshakeMessage::decode(FrameKind::Joined, &b),
            Err(HandshakeError::BadLength {
                expected: 64,
                got: 96,
                ..
            })
        ));
        let joined = HandshakeMessage::Joined(Joined {
            echo: [1; 32],
            proof: [2; 32],
        });
        assert_eq!(round_trip(&joined), joined);
        assert_eq!(joined.opening_nonce(), None);
        assert_eq!(joined.encoded_len(), JOINED_LEN);
        // A PSK handshake ignores rail messages.
        let mut s = Handshake::server(Timestamp::ZERO, cfg(2, 7), [2; 32]);
        s.handle_message(Timestamp::ZERO, &msg);
        assert_eq!((s.is_finished(), s.ignored()), (false, 1));
    }

    #[test]
    fn nonces_are_distinct_and_deterministic() {
        let mut a = NonceGen::new([5; 32]);
        let mut b = NonceGen::new([5; 32]);
        let a1 = a.next_nonce();
        assert_eq!(a1, b.next_nonce());
        assert_ne!(a1, a.next_nonce());
        assert_ne!(a1, NonceGen::new([6; 32]).next_nonce());
        for code in 0..=255u8 {
            assert_eq!(RejectReason::from_u8(code).to_u8(), code);
        }
    }
}
