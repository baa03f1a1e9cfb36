//! The expert cache's admission policy on synthetic routing with known structure (one layer of
//! 64 experts, 4 per token, 16 slots, one token a step), replayed through
//! [`simulate_hit_rates`] with the engine's timing:
//!
//! * stable routing with statistics that match it (the placement static by statistics): after
//!   the warm-up the cache fills almost nothing and hits as often as static placement;
//! * a lasting routing shift: the cache converges to the new hot set;
//! * two sets of experts taking turns: the slots do not follow every turn (no thrash);
//! * the copy budget bounds the fills of any step.
//!
//! The policy before the fill's cost, the settled horizon and the budget
//! (`ExpertCacheOptions::single_horizon`) is printed beside it and, where the scenario is hard,
//! shown to fail what the policy passes.

use ninfer_engine::backend::ExpertSlotTable;
use ninfer_engine::moe::expert_cache::{
    simulate_hit_rates, CacheCounts, ExpertCacheOptions, LayerCachePolicy, LayerRoutingTrace,
};

const EXPERTS: usize = 64;
const PER_TOKEN: usize = 4;
const SLOTS: usize = 16;

/// xorshift64*: the same routing on every machine.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Routing weights: the expert at rank `r` of `order` weighs `1 / (r + 1)^exponent`.
fn zipf(order: &[usize], exponent: f64) -> Vec<f64> {
    let mut weights = vec![0.0; EXPERTS];
    for (rank, &expert) in order.iter().enumerate() {
        weights[expert] = 1.0 / ((rank + 1) as f64).powf(exponent);
    }
    weights
}

/// A permutation of the experts drawn from `random`.
fn shuffled(random: &mut Random) -> Vec<usize> {
    let mut order: Vec<usize> = (0..EXPERTS).collect();
    for i in (1..EXPERTS).rev() {
        let j = (random.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// One token: `PER_TOKEN` distinct experts drawn in proportion to `weights`.
fn token(weights: &[f64], random: &mut Random) -> Vec<u32> {
    let mut left = weights.to_vec();
    let mut chosen = Vec::with_capacity(PER_TOKEN);
    for _ in 0..PER_TOKEN {
        let total: f64 = left.iter().sum();
        let mut point = random.unit() * total;
        let mut pick = left.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        for (expert, &weight) in left.iter().enumerate() {
            if weight > 0.0 && point < weight {
                pick = expert;
                break;
            }
            point -= weight;
        }
        chosen.push(pick as u32);
        left[pick] = 0.0;
    }
    chosen
}

fn trace(weights: &[f64], tokens: usize, random: &mut Random) -> LayerRoutingTrace {
    (0..tokens).map(|_| (token(weights, random), 1)).collect()
}

/// Routed choices per expert over `trace`: the statistics a run leaves.
fn statistics(trace: &[(Vec<u32>, usize)]) -> Vec<u64> {
    let mut counts = vec![0u64; EXPERTS];
    for (ids, _) in trace {
        for &id in ids {
            counts[id as usize] += 1;
        }
    }
    counts
}

/// The cache's counts over `trace[from..]` (the simulation is causal: the counts of the whole
/// trace less those of its first `from` steps).
fn cache_counts_from(
    trace: &LayerRoutingTrace,
    from: usize,
    seed: Option<&[u64]>,
    options: ExpertCacheOptions,
) -> (CacheCounts, CacheCounts) {
    let whole = simulate_hit_rates(trace, EXPERTS, PER_TOKEN, seed, SLOTS, options, None);
    let head = simulate_hit_rates(
        &trace[..from],
        EXPERTS,
        PER_TOKEN,
        seed,
        SLOTS,
        options,
        None,
    );
    let less = |a: CacheCounts, b: CacheCounts| CacheCounts {
        hits: a.hits - b.hits,
        misses: a.misses - b.misses,
        fills: a.fills - b.fills,
        evictions: a.evictions - b.evictions,
        bytes_copied: 0,
    };
    (less(whole.0, head.0), less(whole.1, head.1))
}

fn fills_per_token(counts: &CacheCounts) -> f64 {
    counts.fills as f64 / ((counts.hits + counts.misses) as f64 / PER_TOKEN as f64)
}

fn line(name: &str, counts: &CacheCounts) -> String {
    format!(
        "{name}: hit rate {:.1}%, {:.3} fills per token",
        100.0 * counts.hit_rate(),
        fills_per_token(counts)
    )
}

#[test]
fn stable_routing_with_matching_statistics_fills_almost_nothing() {
    let mut random = Random(0x9E37_79B9_7F4A_7C15);
    let weights = zipf(&shuffled(&mut random), 1.1);
    // The statistics come from another run of the same routing.
    let seed = statistics(&trace(&weights, 20_000, &mut random));
    let decode = trace(&weights, 4_000, &mut random);
    let options = ExpertCacheOptions::default();
    let (fixed, cache) = cache_counts_from(&decode, 500, Some(&seed), options);
    let (_, before) = cache_counts_from(&decode, 500, Some(&seed), options.single_horizon());
    println!("{}", line("static by statistics", &fixed));
    println!("{}", line("cache", &cache));
    println!("{}", line("single-horizon cache", &before));
    assert!(
        fills_per_token(&cache) < 0.005,
        "the cache keeps filling on stable routing: {}",
        line("cache", &cache)
    );
    assert!(
        cache.hit_rate() >= fixed.hit_rate() - 0.005,
        "{} against {}",
        line("cache", &cache),
        line("static", &fixed)
    );
    // The scenario is not trivial: following the recent window alone keeps copying.
    assert!(
        fills_per_token(&before) > 10.0 * fills_per_token(&cache).max(0.001),
        "{}",
        line("single-horizon cache", &before)
    );
}

#[test]
fn a_routing_shift_converges_to_the_new_hot_set() {
    let mut random = Random(0xD1B5_4A32_D192_ED03);
    let before = zipf(&shuffled(&mut random), 1.2);
    let after = zipf(&shuffled(&mut random), 1.2);
    let seed = statistics(&trace(&before, 20_000, &mut random));
    let mut routing = trace(&before, 1_000, &mut random);
    routing.extend(trace(&after, 4_000, &mut random));
    let options = ExpertCacheOptions::default();
    // The last 1,000 tokens: the placement the old statistics give, against the one the new
    // routing's own statistics would give (the best static placement for it).
    let from = routing.len() - 1_000;
    let (stale, cache) = cache_counts_from(&routing, from, Some(&seed), options);
    let oracle_seed = statistics(&routing[1_000..]);
    let (oracle, _) = cache_counts_from(&routing, from, Some(&oracle_seed), options);
    println!("{}", line("static by the old statistics", &stale));
    println!("{}", line("static by the new routing", &oracle));
    println!("{}", line("cache", &cache));
    assert!(
        cache.hit_rate() >= 0.95 * oracle.hit_rate(),
        "the cache did not follow the shift: {} against {}",
        line("cache", &cache),
        line("static by the new routing", &oracle)
    );
    assert!(cache.hit_rate() > stale.hit_rate() + 0.2);
    // Converged: it no longer moves much.
    assert!(fills_per_token(&cache) < 0.05, "{}", line("cache", &cache));
}

#[test]
fn two_sets_taking_turns_do_not_thrash_the_slots() {
    // Sets of 16 experts take turns every 25 tokens, each uniform within its set; the 16 slots
    // hold the first 16 experts, used by neither. Static placement of either set hits half.
    let set_a: Vec<usize> = (16..32).collect();
    let set_b: Vec<usize> = (40..56).collect();
    let uniform = |set: &[usize]| {
        let mut weights = vec![0.0; EXPERTS];
        set.iter().for_each(|&expert| weights[expert] = 1.0);
        weights
    };
    let (a, b) = (uniform(&set_a), uniform(&set_b));
    let mut random = Random(0x94D0_49BB_1331_11EB);
    let routing: LayerRoutingTrace = (0..6_000)
        .map(|step| {
            let weights = if (step / 25) % 2 == 0 { &a } else { &b };
            (token(weights, &mut random), 1)
        })
        .collect();
    let options = ExpertCacheOptions::default();
    let (_, cache) = cache_counts_from(&routing, 2_000, None, options);
    let (_, before) = cache_counts_from(&routing, 2_000, None, options.single_horizon());
    println!("{}", line("cache", &cache));
    println!("{}", line("single-horizon cache", &before));
    assert!(
        fills_per_token(&cache) < 0.01,
        "the slots follow every turn: {}",
        line("cache", &cache)
    );
    // Warmed up, the slots hold experts of the two sets: about half the choices hit.
    assert!(cache.hit_rate() > 0.4, "{}", line("cache", &cache));
    assert!(
        fills_per_token(&before) > 0.1,
        "{}",
        line("single-horizon cache", &before)
    );
}

#[test]
fn the_copy_budget_bounds_each_decision() {
    // A prompt of 64 tokens over every expert, then a decision with 16 free slots: the budget
    // (not the per-layer cap) limits the fills, and the credit carries over to later steps.
    let options = ExpertCacheOptions {
        fills_per_layer: 16,
        ..ExpertCacheOptions::default()
    };
    let rule = options.admission_rule();
    let per_miss = rule
        .fill_credit_per_miss
        .expect("the default options budget the copies");
    let mut policy = LayerCachePolicy::with_rule(EXPERTS, None, PER_TOKEN, rule);
    let table = ExpertSlotTable::new(EXPERTS, SLOTS);
    let prompt: Vec<u32> = (0..64 * PER_TOKEN).map(|i| (i % 8) as u32).collect();
    policy.observe(&prompt, 64);
    let fills = policy.decide(&table, options.fills_per_layer);
    // 8 distinct experts missed.
    let earned = (8.0 * per_miss).floor() as usize;
    assert_eq!(fills.len(), earned.min(8));
    assert!(fills.len() < 8, "the budget let every missed expert in");
    // Without a budget every missed expert worth a fill takes a free slot.
    let unbudgeted = ExpertCacheOptions {
        copy_share_of_step: 0.0,
        ..options
    };
    let mut policy =
        LayerCachePolicy::with_rule(EXPERTS, None, PER_TOKEN, unbudgeted.admission_rule());
    policy.observe(&prompt, 64);
    assert_eq!(policy.decide(&table, options.fills_per_layer).len(), 8);
}
