//! Placement by power-of-K choices: sample K distinct eligible nodes at random and take the least loaded (the
//! policy of tower's `balance::p2c` and linkerd2-proxy, with K = 2 by default). Sampling keeps a burst of
//! placements made from the same (stale) load figures from all landing on the one node that looked emptiest.

use rand::seq::index;
use rand::Rng;

/// The index of the node to place on among `scores` (lower is less loaded), sampling `k` of them; `None` when
/// `scores` is empty. Ties go to the first sampled, which is random.
pub(crate) fn pick(scores: &[f64], k: usize, rng: &mut impl Rng) -> Option<usize> {
    if scores.is_empty() {
        return None;
    }
    let k = k.clamp(1, scores.len());
    index::sample(rng, scores.len(), k)
        .into_iter()
        .min_by(|&a, &b| scores[a].total_cmp(&scores[b]))
}

/// The load score of a node: executions running and queued there (its last `pong`) plus this client's own
/// executions in flight on it (placed since that `pong`, or running), per slot of capacity when the node says
/// how many it has.
pub(crate) fn score(running: u64, queued: u64, in_flight: u64, capacity: Option<u64>) -> f64 {
    let busy = (running + queued + in_flight) as f64;
    match capacity {
        Some(c) if c > 0 => busy / c as f64,
        _ => busy,
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn nothing_to_pick_from_an_empty_set() {
        assert_eq!(pick(&[], 2, &mut StdRng::seed_from_u64(1)), None);
    }

    #[test]
    fn a_single_node_is_always_picked() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..10 {
            assert_eq!(pick(&[5.0], 2, &mut rng), Some(0));
        }
    }

    #[test]
    fn two_nodes_always_go_to_the_less_loaded() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..100 {
            assert_eq!(pick(&[3.0, 1.0], 2, &mut rng), Some(1));
        }
    }

    #[test]
    fn the_most_loaded_of_many_is_never_picked_and_the_rest_share() {
        let mut rng = StdRng::seed_from_u64(3);
        let scores = [0.0, 0.0, 0.0, 9.0];
        let mut counts = [0u32; 4];
        for _ in 0..3000 {
            counts[pick(&scores, 2, &mut rng).unwrap()] += 1;
        }
        assert_eq!(counts[3], 0, "{counts:?}");
        for c in &counts[..3] {
            assert!((800..1200).contains(c), "{counts:?}");
        }
    }

    #[test]
    fn k_of_one_is_uniform_random() {
        let mut rng = StdRng::seed_from_u64(5);
        let mut counts = [0u32; 2];
        for _ in 0..2000 {
            counts[pick(&[0.0, 100.0], 1, &mut rng).unwrap()] += 1;
        }
        assert!(counts[1] > 800, "{counts:?}");
    }

    #[test]
    fn scores_are_per_slot_of_capacity() {
        assert_eq!(score(2, 2, 0, Some(8)), 0.5);
        assert_eq!(score(2, 0, 1, None), 3.0);
        assert_eq!(score(1, 0, 0, Some(0)), 1.0);
        // A node twice as large at the same count is half as loaded.
        assert!(score(4, 0, 0, Some(16)) < score(4, 0, 0, Some(8)));
    }
}
