//! The fallback ladder: the sequence of one-rung demotions the guard walks
//! (static → dynamic → FP), noisiest rung first, within the cap on FP
//! layers, and the bisection for its shortest prefix that passes.
//!
//! It knows nothing about models or held-out data: how noisy a point is at a
//! rung and whether a prefix passes are closures the caller supplies (the
//! guard in production, fakes in the tests below).

use std::collections::BTreeMap;

use qforge_model::artifact::LayerPrecision;

/// Where a point sits on the ladder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Rung {
    /// INT8 with this static activation scale.
    Static(f32),
    /// INT8 with dynamic per-token activations.
    Dynamic,
    /// Full precision.
    Fp,
}

impl Rung {
    /// The precision's name, as artifacts and reports spell it.
    pub(crate) fn name(self) -> &'static str {
        self.precision().name()
    }

    /// The precision a layer at this rung is written with.
    pub(crate) fn precision(self) -> LayerPrecision {
        match self {
            Rung::Static(input_scale) => LayerPrecision::Int8Static { input_scale },
            Rung::Dynamic => LayerPrecision::Int8Dynamic,
            Rung::Fp => LayerPrecision::Fp,
        }
    }

    /// One rung down, `None` at the bottom.
    pub(crate) fn demoted(self) -> Option<Rung> {
        match self {
            Rung::Static(_) => Some(Rung::Dynamic),
            Rung::Dynamic => Some(Rung::Fp),
            Rung::Fp => None,
        }
    }
}

/// A layer input (observation point) as the ladder starts from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Start {
    /// Its rung in the recipe's plan.
    pub rung: Rung,
    /// Linear layers fed by it: they move together (a fused group), and all
    /// of them count against the FP cap.
    pub layers: usize,
    /// Ignored by the recipe: never demoted.
    pub ignored: bool,
}

/// One step of the ladder.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Demotion {
    /// The point demoted.
    pub point: String,
    /// Its rung before.
    pub from: Rung,
    /// Its rung after (always `from.demoted()`).
    pub to: Rung,
}

/// What [`Ladder::shortest_passing`] found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Search<M> {
    /// The shortest prefix that passes has this many steps.
    Passes(usize),
    /// Even the whole ladder fails; its evaluation.
    Exhausted(M),
}

/// How far the ladder may go, in linear layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Caps {
    /// Layers in FP, the plan's own included.
    pub fp_layers: usize,
    /// Layers whose inputs the ladder moves off a static scale (to dynamic,
    /// and perhaps on to FP): unbounded for the guard's ladder, a tenth of
    /// the layers for the method search's measure of a static plan.
    pub moved_off_static: usize,
}

impl Caps {
    /// Only the cap on FP layers.
    pub(crate) fn fp(fp_layers: usize) -> Self {
        Self {
            fp_layers,
            moved_off_static: usize::MAX,
        }
    }
}

/// The demotion sequence from an initial plan.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ladder {
    initial: BTreeMap<String, Rung>,
    demotions: Vec<Demotion>,
    /// Linear layers in FP after each prefix (index: steps applied), so
    /// `fp_layers.len() == demotions.len() + 1`.
    fp_layers: Vec<usize>,
    /// Linear layers moved off a static scale after each prefix.
    moved_off_static: Vec<usize>,
}

impl Ladder {
    /// Builds the ladder: repeatedly demotes, by one rung, the point whose
    /// current rung is noisiest (`noise`, higher worse; ties go to the
    /// smaller name) until no point can move. A point whose demotion would
    /// take the layers in FP, or those moved off a static scale, above
    /// `caps` stays where it is and the ladder goes on with the others, so
    /// every prefix is within the caps whenever the plan itself is.
    pub(crate) fn build(
        points: &BTreeMap<String, Start>,
        caps: Caps,
        noise: impl Fn(&str, Rung) -> f64,
    ) -> Self {
        let initial: BTreeMap<String, Rung> =
            points.iter().map(|(p, s)| (p.clone(), s.rung)).collect();
        let mut fp_now: usize = points
            .values()
            .filter(|s| s.rung == Rung::Fp)
            .map(|s| s.layers)
            .sum();
        let mut moved_now = 0;
        let mut rungs = initial.clone();
        let mut demotions = Vec::new();
        let mut fp_layers = vec![fp_now];
        let mut moved_off_static = vec![moved_now];
        loop {
            let next = rungs
                .iter()
                .filter(|(point, rung)| {
                    let start = &points[*point];
                    match (rung.demoted(), rung) {
                        _ if start.ignored => false,
                        (None, _) => false,
                        (Some(Rung::Fp), _) => fp_now + start.layers <= caps.fp_layers,
                        (Some(_), Rung::Static(_)) => {
                            moved_now + start.layers <= caps.moved_off_static
                        }
                        (Some(_), _) => true,
                    }
                })
                .max_by(|(pa, ra), (pb, rb)| {
                    noise(pa, **ra)
                        .total_cmp(&noise(pb, **rb))
                        .then_with(|| pb.cmp(pa))
                })
                .map(|(p, r)| (p.clone(), *r));
            let Some((point, from)) = next else { break };
            let to = from.demoted().expect("filtered above");
            if to == Rung::Fp {
                fp_now += points[&point].layers;
            }
            if matches!(from, Rung::Static(_)) {
                moved_now += points[&point].layers;
            }
            rungs.insert(point.clone(), to);
            demotions.push(Demotion { point, from, to });
            fp_layers.push(fp_now);
            moved_off_static.push(moved_now);
        }
        Self {
            initial,
            demotions,
            fp_layers,
            moved_off_static,
        }
    }

    /// [`Ladder::build`] where noise figures cost a measurement each and
    /// only those the ladder asks for are worth taking: `noise(state, point,
    /// rung)` is `None` for a figure not taken yet, and `rank(state,
    /// lacking)` takes those. The ladder is built with what is in hand
    /// (a lacking figure counts as 0), the figures it asked for and lacked
    /// are taken, and it is built again until it lacks none: it is then the
    /// ladder every figure would have built, since each of its choices
    /// compared figures all in hand.
    pub(crate) fn build_ranking_as_needed<S, E>(
        points: &BTreeMap<String, Start>,
        caps: Caps,
        state: &mut S,
        noise: impl Fn(&S, &str, Rung) -> Option<f64>,
        mut rank: impl FnMut(&mut S, &[(String, Rung)]) -> Result<(), E>,
    ) -> Result<Self, E> {
        loop {
            let lacking = std::cell::RefCell::new(BTreeMap::new());
            let ladder = Self::build(points, caps, |point, rung| {
                noise(state, point, rung).unwrap_or_else(|| {
                    lacking.borrow_mut().insert(point.to_string(), rung);
                    0.0
                })
            });
            let lacking: Vec<(String, Rung)> = lacking.into_inner().into_iter().collect();
            if lacking.is_empty() {
                return Ok(ladder);
            }
            rank(state, &lacking)?;
        }
    }

    /// Steps in the whole ladder.
    pub(crate) fn len(&self) -> usize {
        self.demotions.len()
    }

    /// The demotions, in order.
    pub(crate) fn demotions(&self) -> &[Demotion] {
        &self.demotions
    }

    /// Every point's rung after the first `steps` demotions.
    pub(crate) fn rungs_at(&self, steps: usize) -> BTreeMap<String, Rung> {
        let mut rungs = self.initial.clone();
        for d in &self.demotions[..steps] {
            rungs.insert(d.point.clone(), d.to);
        }
        rungs
    }

    /// Every point's precision after the first `steps` demotions.
    pub(crate) fn precisions_at(&self, steps: usize) -> BTreeMap<String, LayerPrecision> {
        self.rungs_at(steps)
            .into_iter()
            .map(|(p, r)| (p, r.precision()))
            .collect()
    }

    /// Linear layers in FP after the first `steps` demotions.
    pub(crate) fn fp_layers_at(&self, steps: usize) -> usize {
        self.fp_layers[steps]
    }

    /// Linear layers moved off a static scale by the first `steps`
    /// demotions.
    pub(crate) fn moved_off_static_at(&self, steps: usize) -> usize {
        self.moved_off_static[steps]
    }

    /// The shortest prefix that passes, by bisection: `evaluate(steps)`
    /// measures a prefix, `passes` judges a measurement. The empty prefix
    /// (the plan) must already be known to fail; the whole ladder is
    /// evaluated first (if it fails there is nothing to find), then
    /// O(log n) prefixes in between. It assumes demoting more never hurts:
    /// with a non-monotone guard it still returns a passing prefix, just not
    /// necessarily the shortest.
    pub(crate) fn shortest_passing<M>(
        &self,
        mut evaluate: impl FnMut(usize) -> crate::Result<M>,
        passes: impl Fn(&M) -> bool,
    ) -> crate::Result<Search<M>> {
        let most = evaluate(self.len())?;
        if !passes(&most) {
            return Ok(Search::Exhausted(most));
        }
        // Invariant: `low` fails, `high` passes.
        let (mut low, mut high) = (0, self.len());
        while high - low > 1 {
            let mid = (low + high) / 2;
            if passes(&evaluate(mid)?) {
                high = mid;
            } else {
                low = mid;
            }
        }
        Ok(Search::Passes(high))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(rung: Rung, layers: usize) -> Start {
        Start {
            rung,
            layers,
            ignored: false,
        }
    }

    /// `noise` from a table of (point, rung name) → value; unlisted: 0.
    fn table(entries: &[(&str, &str, f64)]) -> impl Fn(&str, Rung) -> f64 + use<> {
        let entries: Vec<(String, String, f64)> = entries
            .iter()
            .map(|(p, r, v)| (p.to_string(), r.to_string(), *v))
            .collect();
        move |point, rung| {
            entries
                .iter()
                .find(|(p, r, _)| p == point && r == rung.name())
                .map_or(0.0, |e| e.2)
        }
    }

    fn steps(ladder: &Ladder) -> Vec<(String, Rung, Rung)> {
        ladder
            .demotions()
            .iter()
            .map(|d| (d.point.clone(), d.from, d.to))
            .collect()
    }

    fn three_points() -> BTreeMap<String, Start> {
        BTreeMap::from([
            ("a".to_string(), start(Rung::Static(0.5), 1)),
            ("b".to_string(), start(Rung::Static(0.25), 3)),
            ("c".to_string(), start(Rung::Dynamic, 2)),
        ])
    }

    #[test]
    fn demotes_the_noisiest_rung_first_one_rung_at_a_time() {
        let static_name = Rung::Static(1.0).name();
        let dynamic_name = Rung::Dynamic.name();
        let noise = table(&[
            ("a", static_name, 5.0),
            ("a", dynamic_name, 1.0),
            ("b", static_name, 2.0),
            ("b", dynamic_name, 4.0),
            ("c", dynamic_name, 3.0),
        ]);
        let ladder = Ladder::build(&three_points(), Caps::fp(usize::MAX), noise);
        use Rung::*;
        assert_eq!(
            steps(&ladder),
            vec![
                // a's static rung is the noisiest of all (5)...
                ("a".into(), Static(0.5), Dynamic),
                // ...then c's dynamic one (3) beats b's static (2) and a's
                // new dynamic one (1).
                ("c".into(), Dynamic, Fp),
                ("b".into(), Static(0.25), Dynamic),
                ("b".into(), Dynamic, Fp),
                ("a".into(), Dynamic, Fp),
            ]
        );
        assert_eq!(
            (0..=ladder.len())
                .map(|s| ladder.fp_layers_at(s))
                .collect::<Vec<_>>(),
            vec![0, 0, 2, 2, 5, 6]
        );
        assert_eq!(ladder.rungs_at(0)["a"], Static(0.5));
        assert_eq!(ladder.rungs_at(2)["b"], Static(0.25));
        assert_eq!(ladder.rungs_at(3)["b"], Dynamic);
        assert_eq!(
            ladder.precisions_at(ladder.len()),
            BTreeMap::from([
                ("a".to_string(), LayerPrecision::Fp),
                ("b".to_string(), LayerPrecision::Fp),
                ("c".to_string(), LayerPrecision::Fp),
            ])
        );
    }

    #[test]
    fn equal_noise_goes_to_the_smaller_name() {
        let points = BTreeMap::from([
            ("y".to_string(), start(Rung::Dynamic, 1)),
            ("x".to_string(), start(Rung::Dynamic, 1)),
            ("z".to_string(), start(Rung::Dynamic, 1)),
        ]);
        let ladder = Ladder::build(&points, Caps::fp(10), |_, _| 1.0);
        let order: Vec<String> = steps(&ladder).into_iter().map(|s| s.0).collect();
        assert_eq!(order, ["x", "y", "z"]);
    }

    #[test]
    fn demotions_to_fp_stay_within_the_cap() {
        // Only 4 FP layers allowed: a (1 layer) and b (3) fit, after which
        // c (2 more) would exceed the cap and stays dynamic.
        let noise = table(&[("b", Rung::Dynamic.name(), 9.0)]);
        let ladder = Ladder::build(&three_points(), Caps::fp(4), noise);
        for s in 0..=ladder.len() {
            assert!(ladder.fp_layers_at(s) <= 4, "prefix {s} exceeds the cap");
        }
        let rungs = ladder.rungs_at(ladder.len());
        assert_eq!(rungs["a"], Rung::Fp);
        assert_eq!(rungs["b"], Rung::Fp);
        assert_eq!(rungs["c"], Rung::Dynamic, "2 more FP layers exceed the cap");
        assert_eq!(ladder.fp_layers_at(ladder.len()), 4);

        // With no FP allowed, only the static points move, to dynamic.
        let ladder = Ladder::build(&three_points(), Caps::fp(0), |_, _| 0.0);
        assert!(ladder.demotions().iter().all(|d| d.to == Rung::Dynamic));
        assert_eq!(ladder.len(), 2);
    }

    #[test]
    fn moves_off_static_stay_within_their_cap() {
        // 2 layers may leave their static scale: a (1 layer) fits, b (3)
        // does not and keeps its scale; FP moves are capped apart.
        let caps = Caps {
            fp_layers: usize::MAX,
            moved_off_static: 2,
        };
        let noise = table(&[("b", Rung::Static(1.0).name(), 9.0)]);
        let ladder = Ladder::build(&three_points(), caps, noise);
        let rungs = ladder.rungs_at(ladder.len());
        assert_eq!(rungs["b"], Rung::Static(0.25), "3 layers exceed the cap");
        assert_eq!(rungs["a"], Rung::Fp, "a moved off static, then on to FP");
        assert_eq!(rungs["c"], Rung::Fp, "c was never static");
        assert_eq!(
            (0..=ladder.len())
                .map(|s| ladder.moved_off_static_at(s))
                .max(),
            Some(1)
        );
    }

    #[test]
    fn ranking_as_needed_builds_the_ladder_every_figure_builds() {
        // Five static points of one layer each; 2 may leave static. The
        // dynamic figures cost a measurement: only the points the bounded
        // ladder brings to that rung are measured.
        let points: BTreeMap<String, Start> = (0..5)
            .map(|i| (format!("p{i}"), start(Rung::Static(1.0), 1)))
            .collect();
        let caps = Caps {
            fp_layers: 1,
            moved_off_static: 2,
        };
        let figure = |point: &str, rung: Rung| {
            let i: f64 = point[1..].parse().unwrap();
            match rung {
                Rung::Static(_) => 1.0 + i,
                _ => 10.0 - i,
            }
        };
        let whole = Ladder::build(&points, caps, figure);
        let mut ranked: BTreeMap<String, f64> = BTreeMap::new();
        let lazy = Ladder::build_ranking_as_needed(
            &points,
            caps,
            &mut ranked,
            |ranked, point, rung| match rung {
                Rung::Dynamic => ranked.get(point).copied(),
                _ => Some(figure(point, rung)),
            },
            |ranked, lacking| {
                for (point, rung) in lacking {
                    ranked.insert(point.clone(), figure(point, *rung));
                }
                Ok::<(), ()>(())
            },
        )
        .unwrap();
        assert_eq!(lazy, whole);
        // p4 (the noisiest static, 5) moved, its dynamic rung (6) beat p3's
        // static one (4) to the one FP place, then p3 moved; nothing else
        // reached the dynamic rung.
        assert_eq!(
            ranked.keys().collect::<Vec<_>>(),
            ["p3", "p4"],
            "only the moved points' dynamic figures"
        );
        let end = lazy.rungs_at(lazy.len());
        assert_eq!((end["p4"], end["p3"]), (Rung::Fp, Rung::Dynamic));
        assert_eq!(end["p2"], Rung::Static(1.0));
    }

    #[test]
    fn ignored_and_fp_points_never_move() {
        let mut points = three_points();
        points.get_mut("a").expect("a").ignored = true;
        points.insert("d".into(), start(Rung::Fp, 1));
        let ladder = Ladder::build(&points, Caps::fp(usize::MAX), |_, _| 0.0);
        assert!(
            ladder
                .demotions()
                .iter()
                .all(|d| d.point != "a" && d.point != "d")
        );
        assert_eq!(ladder.fp_layers_at(0), 1, "the plan's FP layers count");
    }

    /// A ladder of `n` steps (each point dynamic → FP, `n` points).
    fn ladder_of(n: usize) -> Ladder {
        let points = (0..n)
            .map(|i| (format!("p{i:03}"), start(Rung::Dynamic, 1)))
            .collect();
        let ladder = Ladder::build(&points, Caps::fp(usize::MAX), |_, _| 0.0);
        assert_eq!(ladder.len(), n);
        ladder
    }

    /// Searches `ladder` with a fake evaluation that scores a prefix by its
    /// length, and returns what it found and the lengths it evaluated, in
    /// order, since the tests check how few evaluations the bisection spends.
    fn search(ladder: &Ladder, passes: impl Fn(&usize) -> bool) -> (Search<usize>, Vec<usize>) {
        let mut seen = Vec::new();
        let found = ladder
            .shortest_passing(
                |steps| {
                    seen.push(steps);
                    Ok(steps)
                },
                passes,
            )
            .expect("fake evaluation cannot fail");
        (found, seen)
    }

    #[test]
    fn bisection_finds_the_shortest_passing_prefix() {
        for n in [1, 2, 3, 7, 8, 100] {
            let ladder = ladder_of(n);
            for threshold in 1..=n {
                let (found, seen) = search(&ladder, |&steps| steps >= threshold);
                assert_eq!(found, Search::Passes(threshold), "n {n}");
                assert_eq!(seen[0], n, "the whole ladder first");
                assert!(!seen.contains(&0), "the plan is known to fail");
                let bound = (n as f64).log2().ceil() as usize + 1;
                assert!(seen.len() <= bound, "{} evaluations for n {n}", seen.len());
            }
        }
    }

    #[test]
    fn bisection_reports_a_ladder_that_fails_throughout() {
        let ladder = ladder_of(5);
        let (found, seen) = search(&ladder, |_| false);
        assert_eq!(found, Search::Exhausted(5));
        assert_eq!(seen, [5]);

        // An empty ladder evaluates the plan once more and reports it.
        let empty = ladder_of(0);
        let found = empty.shortest_passing(Ok, |_| false).expect("fake");
        assert_eq!(found, Search::Exhausted(0));
    }

    #[test]
    fn bisection_stops_at_the_first_error() {
        let ladder = ladder_of(8);
        let mut calls = 0;
        let result = ladder.shortest_passing(
            |steps| {
                calls += 1;
                if steps < 8 {
                    Err(crate::Error::HeldOut("boom".into()))
                } else {
                    Ok(steps)
                }
            },
            |_| true,
        );
        assert!(result.is_err());
        assert_eq!(calls, 2);
    }
}
