//! Helpers shared by the scenario tests in `tests/tests/`.
