//! Where transient messages paged out of memory go: the store's
//! [`Spill`](weir_backend::Spill), local and outside the durable contract.
//!
//! A deep entry of a non-durable queue, or a transient message deep in any
//! queue, keeps a spill position instead of its body. Such a position is
//! read back and released through the spill, never through the store:
//! every batch of settles passes through [`release_spilled`] before it is
//! appended, and every read-back through `crate::readback` (which reads a
//! spilled copy from the spill).

use weir_backend::{Op, Store};

/// Releases through the store's spill the spilled copies that `ops`
/// settle, and takes those settles (and requeues of spilled copies) out of
/// `ops`: the durable store never sees a spill position. A dead-letter move
/// whose source is spilled becomes a plain publish of the new message, its
/// source released here.
pub(crate) fn release_spilled(store: &dyn Store, ops: &mut Vec<Op<'_>>) {
    let Some(spill) = store.spill() else {
        return;
    };
    ops.retain_mut(|op| match *op {
        Op::Settle {
            partition,
            id,
            location,
        } if spill.holds(location) => {
            spill.release(partition, id, location);
            false
        }
        Op::Move {
            id,
            partitions,
            data,
            from,
            from_id,
            from_location,
        } if spill.holds(from_location) => {
            spill.release(from, from_id, from_location);
            *op = Op::Publish {
                id,
                partitions,
                data,
            };
            true
        }
        // A spilled copy's delivery state lives in memory only: it dies
        // with the process anyway.
        Op::Requeue { location, .. } if spill.holds(location) => false,
        _ => true,
    });
}
