//! Metadata for several handles: per-key versions, conditional puts and
//! the change feed.
//!
//! The log records every metadata change with its version already. Each
//! key's version is the version of the change that last set it; a restart
//! gives every key the version the map had at open (larger than or equal to
//! its real one, which is all [`crate::Store::put_if`] needs: every later
//! change is larger still). The feed is local (one process holds the log):
//! a bounded history of recent changes in memory, and the wakes of
//! watchers called by the appending thread after it lets go of the lock.

use super::State;
use crate::{MetaEvent, MetaFeed, Wake};
use std::collections::VecDeque;

/// Changes kept for [`crate::Store::watch`] at most; an older `since`
/// gets [`MetaFeed::Reload`].
const HISTORY_CHANGES: usize = 4096;
/// Bytes of keys and values kept in the history at most (retained MQTT
/// messages are metadata too, and may be large).
const HISTORY_BYTES: usize = 8 << 20;

/// The change feed's state, inside the append state.
pub(crate) struct Feed {
    /// Recent changes, oldest first.
    history: VecDeque<MetaEvent>,
    history_bytes: usize,
    /// The smallest `since` the history can answer.
    floor: u64,
    /// Armed by `watch`, called at the next change.
    wakes: Vec<Wake>,
}

impl Feed {
    /// A feed that starts at `version` (the map's version at open).
    pub(crate) fn new(version: u64) -> Feed {
        Feed {
            history: VecDeque::new(),
            history_bytes: 0,
            floor: version,
            wakes: Vec::new(),
        }
    }

    /// Records one change of `key` at `version`.
    pub(crate) fn push(&mut self, version: u64, key: &[u8], value: Option<&[u8]>) {
        self.history_bytes += key.len() + value.map_or(0, <[u8]>::len);
        self.history.push_back(MetaEvent {
            version,
            key: key.to_vec(),
            value: value.map(<[u8]>::to_vec),
        });
        while self.history.len() > HISTORY_CHANGES || self.history_bytes > HISTORY_BYTES {
            let Some(old) = self.history.pop_front() else {
                break;
            };
            self.history_bytes -= old.key.len() + old.value.as_ref().map_or(0, Vec::len);
            self.floor = self.floor.max(old.version);
        }
    }

    /// The wakes to call once the lock is released (after a change).
    pub(crate) fn take_wakes(&mut self) -> Vec<Wake> {
        std::mem::take(&mut self.wakes)
    }

    /// The changes after `since`, or [`MetaFeed::Reload`]; arms `wake` when
    /// there are none yet.
    pub(crate) fn watch(&mut self, since: u64, current: u64, wake: Wake) -> MetaFeed {
        if since < self.floor {
            return MetaFeed::Reload;
        }
        if since >= current {
            self.wakes.push(wake);
            return MetaFeed::Changes(Vec::new());
        }
        MetaFeed::Changes(
            self.history
                .iter()
                .filter(|e| e.version > since)
                .cloned()
                .collect(),
        )
    }
}

impl State {
    /// Applies one metadata change at `version` to the map, the key
    /// versions and the feed.
    pub(crate) fn apply_meta(&mut self, version: u64, key: &[u8], value: Option<&[u8]>) {
        match value {
            Some(v) => {
                self.meta.insert(key.to_vec(), (version, v.to_vec()));
            }
            None => {
                self.meta.remove(key);
            }
        }
        self.feed.push(version, key, value);
    }

    /// The version of `key` now (0: absent).
    pub(crate) fn key_version(&self, key: &[u8]) -> u64 {
        self.meta.get(key).map_or(0, |(version, _)| *version)
    }
}
