//! Errors of collectives and communicator creation.

use std::time::Duration;

use shardcx_shards::proto::NodeId;

/// Why a collective ended on a rank that did not cause it, as the aborting rank told it
/// (one byte on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AbortCause {
    /// The aborting rank's deadline passed.
    TimedOut,
    /// The aborting rank lost another rank (its node's connection ended, a send failed).
    RankFailed,
    /// The aborting rank dropped the collective's future.
    Cancelled,
    /// The aborting rank found the ranks' arguments or messages inconsistent (counts, lengths).
    Mismatch,
    /// A cause this build does not know (from a newer peer).
    Other,
}

/// Why a collective, or the creation of a communicator, failed on this rank. Every variant
/// names the operation and this rank; the ones caused by another rank name it too.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// The operation's deadline passed.
    #[error("{op} on rank {rank}: deadline of {after:?} passed{}", waiting_note(*.waiting_for))]
    TimedOut {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank whose message this rank was waiting for, if it was waiting for one.
        waiting_for: Option<usize>,
        /// The deadline given to the operation.
        after: Duration,
    },
    /// Another rank cannot take part any more: its node's connection ended, or a message to it
    /// could not be sent.
    #[error("{op} on rank {rank}: rank {failed} failed: {cause}")]
    RankFailed {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that failed.
        failed: usize,
        /// What happened to it (the connection's or the send's error).
        cause: String,
    },
    /// Another rank ended this collective (it failed there) and told this one.
    #[error("{op} on rank {rank}: aborted by rank {by} ({cause:?})")]
    Aborted {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that aborted it.
        by: usize,
        /// Why it did.
        cause: AbortCause,
    },
    /// The communicator is revoked: an earlier operation failed (here or on rank `by`, which
    /// will not take part in later ones). Every operation fails at once from then on; make a
    /// new communicator.
    #[error("{op} on rank {rank}: the communicator is revoked (rank {by} failed: {cause:?})")]
    Revoked {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank whose failure revoked it (this rank, when it failed here).
        by: usize,
        /// Why it failed.
        cause: AbortCause,
    },
    /// The ranks disagree: a message of the wrong length (different counts on different
    /// ranks), or different members of a new communicator.
    #[error("{op} on rank {rank}: mismatch with rank {other}: {what}")]
    Mismatch {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank whose message or view differs.
        other: usize,
        /// What differs.
        what: String,
    },
    /// An argument this rank passed is not valid (a root out of range, a length that does not
    /// divide by the rank count).
    #[error("{op}: invalid argument: {what}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        what: String,
    },
    /// A node of the world could not be reached within the deadline.
    #[error("{op}: node {node} not reachable: {cause}")]
    Unreachable {
        /// The operation.
        op: &'static str,
        /// The node.
        node: NodeId,
        /// Why (no session within the deadline, or the connect's error).
        cause: String,
    },
    /// [`crate::collective::Communicator::shrink`] left this rank out: another survivor saw
    /// it as failed (its node's connection ended there, as after a partition).
    #[error(
        "{op} on rank {rank}: left out of the shrunk communicator (rank {by} saw it as failed)"
    )]
    Excluded {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that decided the survivors.
        by: usize,
    },
    /// The discovery registry could not be asked, or did not list the nodes in time
    /// ([`crate::collective::Communicator::world_from_registry`]).
    #[error("{op}: discovery: {cause}")]
    Discovery {
        /// The operation.
        op: &'static str,
        /// What went wrong.
        cause: String,
    },
    /// This node is shutting down.
    #[error("{op} on rank {rank}: this node is shutting down")]
    ShuttingDown {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
    },
    /// The call was made outside a shard thread of a running [`crate::Node`].
    #[error("not called on a shard of a running node")]
    NotOnShard,
}

fn waiting_note(w: Option<usize>) -> String {
    w.map(|r| format!(" waiting for rank {r}"))
        .unwrap_or_default()
}

impl AbortCause {
    pub(crate) fn to_wire(self) -> u8 {
        match self {
            AbortCause::TimedOut => 1,
            AbortCause::RankFailed => 2,
            AbortCause::Cancelled => 3,
            AbortCause::Mismatch => 4,
            AbortCause::Other => 255,
        }
    }

    pub(crate) fn from_wire(b: u8) -> AbortCause {
        match b {
            1 => AbortCause::TimedOut,
            2 => AbortCause::RankFailed,
            3 => AbortCause::Cancelled,
            4 => AbortCause::Mismatch,
            _ => AbortCause::Other,
        }
    }
}

impl CollectiveError {
    /// The cause to tell the other ranks when this error ends a collective here, or `None`
    /// when it came from another rank (an abort is not echoed) or concerns this rank's
    /// arguments only.
    pub(crate) fn abort_cause(&self) -> Option<AbortCause> {
        match self {
            CollectiveError::TimedOut { .. } => Some(AbortCause::TimedOut),
            CollectiveError::RankFailed { .. } => Some(AbortCause::RankFailed),
            CollectiveError::Mismatch { .. } | CollectiveError::InvalidArgument { .. } => {
                Some(AbortCause::Mismatch)
            }
            CollectiveError::Unreachable { .. } | CollectiveError::ShuttingDown { .. } => {
                Some(AbortCause::RankFailed)
            }
            CollectiveError::Discovery { .. } => None,
            CollectiveError::Aborted { .. }
            | CollectiveError::Revoked { .. }
            | CollectiveError::Excluded { .. }
            | CollectiveError::NotOnShard => None,
        }
    }
}
