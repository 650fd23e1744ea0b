//! Numbers for the handles a device gives out (PDs, MRs, CQs, SRQs, AHs).
//!
//! Handles are numbered from 1 upwards and the counter wraps after 2^32 creations. A program
//! that keeps one object and creates and destroys others (a UD server making an address handle
//! per request, say) gets there; a number still in use must then be skipped, or the new object
//! would replace the live one in its table (a deregistered region's keys would stay valid, a
//! destroyed queue would take another's completions).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

/// The next number from `next` (never 0) whose handle `make(n)` is not a key of `taken`;
/// advances `next` past it. Ends because `taken` holds fewer than 2^32 - 1 entries.
pub(crate) fn next_free<K: Eq + Hash, V, S: BuildHasher>(
    next: &mut u32,
    taken: &HashMap<K, V, S>,
    make: impl Fn(u32) -> K,
) -> K {
    loop {
        let n = (*next).max(1);
        *next = n.wrapping_add(1).max(1);
        let id = make(n);
        if !taken.contains_key(&id) {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_count_up_from_one() {
        let taken: HashMap<u32, ()> = HashMap::new();
        let mut next = 1;
        let got: Vec<u32> = (0..3)
            .map(|_| next_free(&mut next, &taken, |n| n))
            .collect();
        assert_eq!(got, [1, 2, 3]);
    }

    #[test]
    fn after_the_wrap_numbers_in_use_are_skipped_and_zero_is_never_given() {
        let taken: HashMap<u32, ()> = [(1, ()), (2, ()), (u32::MAX, ())].into();
        let mut next = u32::MAX - 1;
        let got: Vec<u32> = (0..3)
            .map(|_| next_free(&mut next, &taken, |n| n))
            .collect();
        assert_eq!(got, [u32::MAX - 1, 3, 4]);
    }
}
