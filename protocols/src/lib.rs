//! Sans-IO protocol adapters.
