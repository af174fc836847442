//! # Routing: which experts see which tokens
//!
//! The router scores every expert for every token (`p = softmax(z)` or `σ(z)`, `z = x W_r`;
//! `model.rs`). Choosing experts is not differentiable, so it happens once, here, on the host,
//! from a copy of the scores; the routing weights are then gathered from the scores on the
//! device, where gradients flow. For each token `t`:
//!
//! ```text
//! s_t = p_t + b                         selection scores (b: the selection bias, or 0)
//! G_t = top_topk_group over groups g of  Σ top-m { s_te : e ∈ g }      (group-limited routing;
//!                                         m = group_score_top: 2 DeepSeek-V3, 1 DeepSeek-V2)
//! S_t = top_k { s_te : e ∈ ∪ G_t }      the token's experts, best first
//! ```
//!
//! Ties go to the lower index (group or expert); NaN scores order above every number, so a
//! NaN input still routes (and yields NaN) instead of failing. Without groups (`n_group = 1`)
//! `G_t` is every expert.
//!
//! **Capacity** (Switch): with a capacity `C`, the token–expert pairs are admitted in slot
//! order, all tokens' first choices before any second choice, and within a slot in token order;
//! an expert admits its first `C` pairs and drops the rest. A dropped pair contributes nothing
//! to its token (the other weights are not renormalised).
//!
//! The admitted pairs are then listed expert by expert (within an expert in token order), so
//! that each expert's tokens are one contiguous block of rows for its matrix products.

/// What routing needs to know of the layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RouteSpec {
    pub n_experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// How many of a group's best scores make its score.
    pub group_score_top: usize,
    /// The most pairs an expert admits; `None`: dropless.
    pub capacity: Option<usize>,
}

/// The routing of one batch of `T` tokens.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Routing {
    /// Each token's experts, best first: `selected[t · k + j]`, `[T · k]`.
    pub selected: Vec<usize>,
    /// The admitted pairs, expert by expert: the token (row of `x`) of each.
    pub tokens: Vec<usize>,
    /// The same pairs' slot `t · k + j` in `selected` (and in the `[T, k]` routing weights).
    pub slots: Vec<usize>,
    /// Admitted pairs per expert (`tokens_per_expert`): expert `e`'s rows are the block of
    /// `groups[e]` rows after those of experts `0..e`.
    pub groups: Vec<usize>,
    /// Pairs that chose each expert, before capacity.
    pub chosen: Vec<usize>,
}

impl Routing {
    /// Pairs dropped by capacity.
    pub fn dropped(&self) -> usize {
        self.selected.len() - self.tokens.len()
    }
}

/// Descending by value, ties to the lower index; NaN above everything.
fn better(a: (usize, f32), b: (usize, f32)) -> std::cmp::Ordering {
    let key = |v: f32| if v.is_nan() { f32::INFINITY } else { v };
    key(b.1)
        .total_cmp(&key(a.1))
        .then_with(|| b.1.is_nan().cmp(&a.1.is_nan()))
        .then_with(|| a.0.cmp(&b.0))
}

/// The indices of the `k` best of `values` (see [`better`]), best first.
fn top(values: impl Iterator<Item = (usize, f32)>, k: usize) -> Vec<usize> {
    let mut all: Vec<(usize, f32)> = values.collect();
    let k = k.min(all.len());
    if k == 0 {
        return Vec::new();
    }
    if k < all.len() {
        all.select_nth_unstable_by(k - 1, |a, b| better(*a, *b));
        all.truncate(k);
    }
    all.sort_by(|a, b| better(*a, *b));
    all.into_iter().map(|(i, _)| i).collect()
}

/// Routes `tokens` tokens given their scores `p` (`[T, E]`, row-major) and the selection bias.
pub(crate) fn route(
    scores: &[f32],
    bias: Option<&[f32]>,
    tokens: usize,
    spec: RouteSpec,
) -> Routing {
    let RouteSpec {
        n_experts: e_count,
        top_k: k,
        n_group,
        topk_group,
        group_score_top,
        capacity,
    } = spec;
    debug_assert_eq!(scores.len(), tokens * e_count);
    let group_size = e_count / n_group;
    let mut selected = Vec::with_capacity(tokens * k);
    let mut s = vec![0f32; e_count];
    for t in 0..tokens {
        let p = &scores[t * e_count..(t + 1) * e_count];
        for (e, value) in s.iter_mut().enumerate() {
            *value = p[e] + bias.map_or(0.0, |b| b[e]);
        }
        if n_group > 1 {
            // Σ of the `group_score_top` best selection scores of each group (all of them in
            // groups that small).
            let group_score = |g: usize| -> f32 {
                let members = &s[g * group_size..(g + 1) * group_size];
                top(members.iter().copied().enumerate(), group_score_top)
                    .into_iter()
                    .map(|i| members[i])
                    .sum()
            };
            let groups = top((0..n_group).map(|g| (g, group_score(g))), topk_group);
            let allowed = groups
                .iter()
                .flat_map(|g| g * group_size..(g + 1) * group_size);
            let mut chosen = top(allowed.map(|e| (e, s[e])), k);
            selected.append(&mut chosen);
        } else {
            selected.extend(top(s.iter().copied().enumerate(), k));
        }
    }

    let mut chosen = vec![0usize; e_count];
    for &e in &selected {
        chosen[e] += 1;
    }
    // Admission: slot by slot, token by token.
    let mut admitted = vec![true; selected.len()];
    if let Some(cap) = capacity {
        let mut load = vec![0usize; e_count];
        for j in 0..k {
            for t in 0..tokens {
                let e = selected[t * k + j];
                if load[e] < cap {
                    load[e] += 1;
                } else {
                    admitted[t * k + j] = false;
                }
            }
        }
    }
    // Expert by expert (a counting sort), in token order within an expert.
    let mut groups = vec![0usize; e_count];
    for (slot, &e) in selected.iter().enumerate() {
        groups[e] += usize::from(admitted[slot]);
    }
    let mut next: Vec<usize> = groups
        .iter()
        .scan(0, |start, &n| {
            let here = *start;
            *start += n;
            Some(here)
        })
        .collect();
    let kept = groups.iter().sum();
    let (mut token_of, mut slot_of) = (vec![0; kept], vec![0; kept]);
    for (slot, &e) in selected.iter().enumerate() {
        if admitted[slot] {
            token_of[next[e]] = slot / k;
            slot_of[next[e]] = slot;
            next[e] += 1;
        }
    }
    Routing {
        selected,
        tokens: token_of,
        slots: slot_of,
        groups,
        chosen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n_experts: usize, top_k: usize) -> RouteSpec {
        RouteSpec {
            n_experts,
            top_k,
            n_group: 1,
            topk_group: 1,
            group_score_top: 2,
            capacity: None,
        }
    }

    #[test]
    fn top_k_best_first_ties_to_the_lower_index() {
        let scores = [0.1, 0.4, 0.4, 0.1, /* token 1 */ 0.7, 0.1, 0.1, 0.1];
        let r = route(&scores, None, 2, spec(4, 2));
        assert_eq!(r.selected, vec![1, 2, 0, 1]);
        assert_eq!(r.groups, vec![1, 2, 1, 0]);
        // Expert 0: token 1 (slot 2); expert 1: tokens 0 (slot 0) and 1 (slot 3); expert 2: token 0.
        assert_eq!(r.tokens, vec![1, 0, 1, 0]);
        assert_eq!(r.slots, vec![2, 0, 3, 1]);
        assert_eq!(r.chosen, vec![1, 2, 1, 0]);
        assert_eq!(r.dropped(), 0);
    }

    #[test]
    fn the_selection_bias_chooses_but_nan_still_routes() {
        let scores = [0.5, 0.3, 0.2];
        let r = route(&scores, Some(&[0.0, 0.0, 0.4]), 1, spec(3, 1));
        assert_eq!(r.selected, vec![2]);
        let r = route(&[0.5, f32::NAN, 0.2], None, 1, spec(3, 2));
        assert_eq!(r.selected, vec![1, 0]);
    }

    #[test]
    fn groups_limit_the_choice() {
        // 4 groups of 2; group scores (sum of both): 0.3, 1.0, 0.9, 0.2 → groups 1 and 2.
        let scores = [0.1, 0.2, 0.5, 0.5, 0.0, 0.9, 0.1, 0.1];
        let mut s = spec(8, 3);
        s.n_group = 4;
        s.topk_group = 2;
        let r = route(&scores, None, 1, s);
        assert_eq!(r.selected, vec![5, 2, 3]);
        // Expert 1 (0.2) beats expert 4 (0.0) globally, but its group is out.
        s.topk_group = 1;
        s.top_k = 2;
        assert_eq!(route(&scores, None, 1, s).selected, vec![2, 3]);
        // Scored by its best member (DeepSeek-V2): 0.2, 0.5, 0.9, 0.1 → group 2.
        s.group_score_top = 1;
        assert_eq!(route(&scores, None, 1, s).selected, vec![5, 4]);
    }

    #[test]
    fn capacity_admits_first_choices_first_then_tokens_in_order() {
        // 4 tokens, 2 experts, top-2: every token chooses both; first choices: 0, 0, 1, 0.
        let scores = [0.9, 0.1, 0.8, 0.2, 0.3, 0.7, 0.6, 0.4];
        let mut s = spec(2, 2);
        s.capacity = Some(3);
        let r = route(&scores, None, 4, s);
        assert_eq!(r.selected, vec![0, 1, 0, 1, 1, 0, 0, 1]);
        // Expert 0 admits the first choices of tokens 0, 1, 3, then is full: token 2's second
        // choice (slot 5) is dropped. Expert 1 admits token 2's first choice, then the second
        // choices of tokens 0 and 1; token 3's (slot 7) is dropped.
        assert_eq!(r.groups, vec![3, 3]);
        assert_eq!(r.tokens, vec![0, 1, 3, 0, 1, 2]);
        assert_eq!(r.slots, vec![0, 2, 6, 1, 3, 4]);
        assert_eq!(r.dropped(), 2);
        assert_eq!(r.chosen, vec![4, 4]);
    }
}
