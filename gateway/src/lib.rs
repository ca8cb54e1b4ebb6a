//! The Weir gateway.
