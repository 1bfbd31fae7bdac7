//! What loading refuses, for its numbers (issue 55, point 5): every attack
//! of `tampered` is refused by `check_numbers`, and loading (what `serve`,
//! `/admin/reload`, `act`, `eval`, `generate` and `requantize` do) refuses
//! it with the very same message. Before, a weight scale of 1e-40 or 3e38
//! and an activation scale of 1e-40, 1e-30 or 3e38 loaded.

#[path = "support/files.rs"]
mod files;
mod tampered;

use files::fresh_dir;
use qforge_model::artifact::check_numbers;
use tampered::{ATTACKS, REMEDY, cartpole_artifact};

#[test]
fn the_untouched_artifact_passes_and_loads() {
    let dir = fresh_dir("clean");
    cartpole_artifact(dir.path());
    check_numbers(dir.path()).unwrap();
    qforge_model::open(dir.path()).unwrap();
}

#[test]
fn loading_refuses_every_tampered_number_with_the_checks_message() {
    for attack in ATTACKS {
        let dir = fresh_dir("tampered");
        let dir = dir.path();
        cartpole_artifact(dir);
        attack.apply(dir);
        let checked = check_numbers(dir).unwrap_err().to_string();
        assert!(
            checked.contains(attack.expected) && checked.contains(REMEDY),
            "{attack:?}: {checked}"
        );
        let loaded = qforge_model::open(dir).unwrap_err().to_string();
        assert_eq!(loaded, checked, "{attack:?}");
    }
}
