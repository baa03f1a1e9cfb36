//! Which indices PyTorch's CPU `topk(k, largest=True)` returns when values tie.
//!
//! The QSA scores are sums of ReLUs, so blocks often tie at exactly zero, and which tied block
//! transformers keeps decides which tokens a query sees. PyTorch's CPU kernel pairs every value
//! with its index and, with a "greater value" comparison that ignores the index, runs the C++
//! standard library's `partial_sort` when `64·k ≤ n` and `nth_element` otherwise; the first `k`
//! pairs are the answer. Those algorithms (as in GNU libstdc++, which PyTorch's Linux builds use)
//! are reproduced step for step here so ties resolve the same way. Only the selected set matters
//! to QSA, so the final sort of the kept pairs is left out.
//!
//! Owns: the selected index set of a descending top-k with ties resolved as PyTorch does.
//! Must not touch: anything model-specific.

type Pair = (f32, usize);

fn greater(a: &Pair, b: &Pair) -> bool {
    a.0 > b.0
}

/// libstdc++ `__adjust_heap` + `__push_heap` on `heap[..length]` (a "max" heap for `greater`,
/// i.e. the smallest value on top).
fn adjust_heap(heap: &mut [Pair], mut hole: usize, length: usize, value: Pair) {
    let top = hole;
    let mut second = hole;
    while second < (length - 1) / 2 {
        second = 2 * (second + 1);
        if greater(&heap[second], &heap[second - 1]) {
            second -= 1;
        }
        heap[hole] = heap[second];
        hole = second;
    }
    if length & 1 == 0 && second == (length - 2) / 2 {
        second = 2 * (second + 1);
        heap[hole] = heap[second - 1];
        hole = second - 1;
    }
    while hole > top {
        let parent = (hole - 1) / 2;
        if !greater(&heap[parent], &value) {
            break;
        }
        heap[hole] = heap[parent];
        hole = parent;
    }
    heap[hole] = value;
}

fn make_heap(heap: &mut [Pair]) {
    let length = heap.len();
    if length < 2 {
        return;
    }
    let mut parent = (length - 2) / 2;
    loop {
        let value = heap[parent];
        adjust_heap(heap, parent, length, value);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// libstdc++ `__heap_select(first, first + middle, end)`.
fn heap_select(pairs: &mut [Pair], middle: usize) {
    make_heap(&mut pairs[..middle]);
    for i in middle..pairs.len() {
        if greater(&pairs[i], &pairs[0]) {
            let value = pairs[i];
            pairs[i] = pairs[0];
            adjust_heap(&mut pairs[..middle], 0, middle, value);
        }
    }
}

fn insertion_sort(pairs: &mut [Pair]) {
    for i in 1..pairs.len() {
        let value = pairs[i];
        if greater(&value, &pairs[0]) {
            pairs.copy_within(0..i, 1);
            pairs[0] = value;
        } else {
            let mut j = i;
            while greater(&value, &pairs[j - 1]) {
                pairs[j] = pairs[j - 1];
                j -= 1;
            }
            pairs[j] = value;
        }
    }
}

fn move_median_to_first(pairs: &mut [Pair], result: usize, a: usize, b: usize, c: usize) {
    let chosen = if greater(&pairs[a], &pairs[b]) {
        if greater(&pairs[b], &pairs[c]) {
            b
        } else if greater(&pairs[a], &pairs[c]) {
            c
        } else {
            a
        }
    } else if greater(&pairs[a], &pairs[c]) {
        a
    } else if greater(&pairs[b], &pairs[c]) {
        c
    } else {
        b
    };
    pairs.swap(result, chosen);
}

/// libstdc++ `__unguarded_partition(first, last, pivot)` over `pairs[first..last]`.
fn unguarded_partition(
    pairs: &mut [Pair],
    mut first: usize,
    mut last: usize,
    pivot: usize,
) -> usize {
    loop {
        while greater(&pairs[first], &pairs[pivot]) {
            first += 1;
        }
        last -= 1;
        while greater(&pairs[pivot], &pairs[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        pairs.swap(first, last);
        first += 1;
    }
}

/// libstdc++ `nth_element` (introselect).
fn nth_element(pairs: &mut [Pair], nth: usize) {
    let (mut first, mut last) = (0usize, pairs.len());
    if first == last || nth == last {
        return;
    }
    let mut depth_limit = 2 * (usize::BITS - 1 - pairs.len().leading_zeros()) as usize;
    while last - first > 3 {
        if depth_limit == 0 {
            heap_select(&mut pairs[first..last], nth + 1 - first);
            pairs.swap(first, nth);
            return;
        }
        depth_limit -= 1;
        let middle = first + (last - first) / 2;
        move_median_to_first(pairs, first, first + 1, middle, last - 1);
        let cut = unguarded_partition(pairs, first + 1, last, first);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut pairs[first..last]);
}

/// The indices (ascending) of the `k` largest `values` that PyTorch's CPU `topk` picks.
/// `k` is clamped to `values.len()`.
pub fn torch_top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let mut pairs: Vec<Pair> = values.iter().copied().zip(0..).collect();
    if k * 64 <= pairs.len() {
        heap_select(&mut pairs, k);
    } else {
        nth_element(&mut pairs, k - 1);
    }
    let mut indices: Vec<usize> = pairs[..k].iter().map(|pair| pair.1).collect();
    indices.sort_unstable();
    indices
}
