//! Tests of the log store.
