//! The embedded log store. (Being implemented.)
