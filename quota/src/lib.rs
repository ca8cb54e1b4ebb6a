//! Tenant limits and credit primitives.
