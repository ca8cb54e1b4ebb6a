//! The log store's own failures, inside [`StoreError::Backend`]: what a
//! neutral store error cannot say (segments, offsets, on-disk formats, the
//! data directory's lock).

use crate::{MessageId, PartitionId, StoreError};

/// Id of a segment file of the embedded log (a monotonically increasing number).
pub type SegmentId = u32;

/// Failures only the log store has. Reached through
/// [`StoreError::backend`]`::<LogError>()`.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A record failed its checksum or could not be decoded where it must be intact.
    #[error("corrupt record at segment {segment} offset {offset}: {reason}")]
    Corrupt {
        /// Segment.
        segment: SegmentId,
        /// Offset.
        offset: u64,
        /// Why.
        reason: String,
    },
    /// Another process holds the data directory's lock.
    #[error(
        "data directory {} is in use by another weir process{}; refusing to share it",
        dir.display(),
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The pid written into the lock file by the holder, if readable.
        holder: Option<u32>,
    },
    /// Damage in the log that is not a torn tail: valid records follow it (or
    /// it is in a sealed segment), so it may hold confirmed data. The store
    /// refuses to open rather than drop it silently.
    #[error("{0}. Refusing to start so that nothing confirmed is dropped silently: run `weir repair` with the same --data-dir (or start with --repair) to move the damaged range into quarantine/ and keep every valid record")]
    Damaged(Box<Damage>),
    /// The data directory was written in an on-disk format this build does
    /// not read (an older Weir without versioned segments, or a newer one).
    /// Nothing was changed.
    #[error("data directory {} holds a log in format {found} ({}), but this build of weir reads log format {expected}. Nothing was changed. {advice}", dir.display(), file.display())]
    UnsupportedFormat {
        /// The data directory.
        dir: std::path::PathBuf,
        /// The first file in the unsupported format.
        file: std::path::PathBuf,
        /// The format found (0 = segments without a header, before versions).
        found: u32,
        /// The format this build reads and writes.
        expected: u32,
        /// What to do about it.
        advice: String,
    },
}

impl From<LogError> for StoreError {
    fn from(e: LogError) -> Self {
        StoreError::Backend(Box::new(e))
    }
}

impl LogError {
    /// The log error inside `e`, if it is one.
    pub fn of(e: &StoreError) -> Option<&LogError> {
        e.backend::<LogError>()
    }
}

/// A corrupt record, as a [`StoreError`].
pub(crate) fn corrupt(segment: SegmentId, offset: u64, reason: impl Into<String>) -> StoreError {
    LogError::Corrupt {
        segment,
        offset,
        reason: reason.into(),
    }
    .into()
}

/// A damaged byte range of a segment file found at recovery.
#[derive(Debug, Clone)]
pub struct Damage {
    /// The segment file.
    pub file: std::path::PathBuf,
    /// The segment.
    pub segment: SegmentId,
    /// First damaged byte.
    pub offset: u64,
    /// Length of the damaged range (up to the next valid record).
    pub len: u64,
    /// Why the first record there was rejected.
    pub reason: String,
    /// What the range held, as far as its record headers are readable.
    pub lost: Vec<LostRecord>,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "corrupt data in log segment {} at offset {} ({} bytes: {}), not a torn tail; lost: ",
            self.file.display(),
            self.offset,
            self.len,
            self.reason
        )?;
        if self.lost.is_empty() {
            write!(
                f,
                "bytes {}..{} (no readable record header)",
                self.offset,
                self.offset + self.len
            )?;
        }
        for (i, l) in self.lost.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{l}")?;
        }
        Ok(())
    }
}

/// One record (or unreadable stretch) inside a damaged range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LostRecord {
    /// A message record (publish, page, relocated copy, or the new message
    /// of a move, which also lists a [`LostRecord::Settle`]).
    Message {
        /// Its id.
        id: MessageId,
        /// The partitions it was live in.
        partitions: Vec<PartitionId>,
    },
    /// A settle: the message may come back after repair (a duplicate, not a loss).
    Settle {
        /// The partition.
        partition: PartitionId,
        /// The message.
        id: MessageId,
    },
    /// A requeue: the message's delivery count and retry delay may go back.
    Requeue {
        /// The partition.
        partition: PartitionId,
        /// The message.
        id: MessageId,
    },
    /// An idempotency receipt: a duplicate of its message may be accepted
    /// again after repair.
    Receipt {
        /// The partition (queue) it was for.
        partition: PartitionId,
    },
    /// A metadata change (a declare, bind or delete may be undone).
    Meta {
        /// Its version.
        version: u64,
    },
    /// A partition drop or truncation ([`crate::Op::DropPartition`],
    /// [`crate::Op::Truncate`]): its messages may come back after repair.
    Cut {
        /// The partition.
        partition: PartitionId,
        /// The first id kept (`u64::MAX` for a drop).
        before: MessageId,
    },
    /// A state-store change ([`crate::Op::PutState`],
    /// [`crate::Op::DeleteState`]): the key may show an older value after
    /// repair.
    State {
        /// The key.
        key: Vec<u8>,
    },
    /// Bytes with no readable record header.
    Unreadable {
        /// Offset in the segment.
        offset: u64,
        /// Length.
        len: u64,
    },
}

impl std::fmt::Display for LostRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LostRecord::Message { id, partitions } => {
                write!(
                    f,
                    "message id {id} in partitions {:?}",
                    partitions.iter().map(|p| p.0).collect::<Vec<_>>()
                )
            }
            LostRecord::Settle { partition, id } => {
                write!(
                    f,
                    "settle of message {id} in partition {} (it may be delivered again)",
                    partition.0
                )
            }
            LostRecord::Requeue { partition, id } => {
                write!(
                    f,
                    "requeue of message {id} in partition {} (its delivery count may go back)",
                    partition.0
                )
            }
            LostRecord::Receipt { partition } => write!(
                f,
                "idempotency receipt in partition {} (a duplicate publish may be accepted)",
                partition.0
            ),
            LostRecord::Meta { version } => write!(f, "metadata change version {version}"),
            LostRecord::Cut { partition, before } if *before == MessageId::MAX => write!(
                f,
                "drop of partition {} (its messages may come back)",
                partition.0
            ),
            LostRecord::Cut { partition, before } => write!(
                f,
                "truncation of partition {} before message {before} (those messages may come back)",
                partition.0
            ),
            LostRecord::State { key } => write!(
                f,
                "state change of key {:?} (an older value may come back)",
                String::from_utf8_lossy(key)
            ),
            LostRecord::Unreadable { offset, len } => {
                write!(f, "{len} unreadable bytes at offset {offset}")
            }
        }
    }
}
