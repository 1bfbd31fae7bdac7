//! LLM episodes with a verifiable reward (`qforge rollouts`): a language
//! model answers seeded problems with its own sampler, and each answer is
//! scored exactly, so a policy can be calibrated on its own behaviour (good
//! and bad episodes alike) and its INT8 twin scored by the same reward.

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Serialize;

use qforge_decode::{GenerateOptions, generate};
use qforge_formats::text::TextSide;
use qforge_model::LanguageModel;
use qforge_model::Result;

/// A task with an exact reward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// "What is A op B?" with A, B in 1..=20 and op one of + - *; reward 1
    /// when the completion's last whole integer is the result.
    Arithmetic,
}

impl Task {
    /// The task's name in episode ids and reports.
    pub fn name(self) -> &'static str {
        match self {
            Task::Arithmetic => "arithmetic",
        }
    }
}

/// How episodes are drawn and generated.
#[derive(Clone, Copy, Debug)]
pub struct RolloutOptions {
    /// The task.
    pub task: Task,
    /// Episodes to generate.
    pub episodes: usize,
    /// Seed of the problems and of every episode's sampler.
    pub seed: u64,
    /// Sampling temperature.
    pub temperature: f64,
    /// Most tokens per completion.
    pub max_tokens: usize,
}

impl RolloutOptions {
    /// Checks the options; the error names the one out of range.
    pub fn validate(&self) -> Result<()> {
        if self.episodes == 0 || self.max_tokens == 0 {
            return Err(qforge_formats::Error::Request(
                "episodes and max_tokens must be at least 1".into(),
            )
            .into());
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(qforge_formats::Error::Request(format!(
                "temperature must be ≥ 0, got {}",
                self.temperature
            ))
            .into());
        }
        Ok(())
    }
}

/// One episode, in the calibration data's shape.
#[derive(Clone, Debug, Serialize)]
pub struct Episode {
    /// The user's message.
    pub prompt: String,
    /// The model's completion.
    pub completion: String,
    /// 1 for a correct answer, else 0.
    pub reward: f64,
    /// `TASK-sSEED-INDEX`.
    pub episode_id: String,
    /// "stop" (end-of-sequence token) or "length" (cut off at max_tokens).
    pub finish: &'static str,
    /// Tokens generated.
    #[serde(skip)]
    pub tokens: usize,
}

/// A set of episodes summed up: what `qforge rollouts` reports.
#[derive(Clone, Debug, Serialize)]
pub struct RolloutsSummary {
    /// The task's name.
    pub task: &'static str,
    /// Episodes generated.
    pub episodes: usize,
    /// Mean reward.
    pub mean_reward: f64,
    /// Episodes by reward: `"0"` and `"1"`.
    pub reward_counts: std::collections::BTreeMap<&'static str, usize>,
    /// Completions cut off at the token limit.
    pub cut_off: usize,
    /// Tokens generated over all episodes.
    pub generated_tokens: usize,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Seed of the problems and samplers.
    pub seed: u64,
    /// Sampling temperature.
    pub temperature: f64,
    /// Most tokens per completion.
    pub max_tokens: usize,
}

impl RolloutsSummary {
    /// The summary of `episodes`, generated with `options` in `seconds`.
    pub fn of(episodes: &[Episode], options: &RolloutOptions, seconds: f64) -> Self {
        let rewarded = episodes.iter().filter(|e| e.reward > 0.0).count();
        Self {
            task: options.task.name(),
            episodes: episodes.len(),
            mean_reward: rewarded as f64 / episodes.len().max(1) as f64,
            reward_counts: [("0", episodes.len() - rewarded), ("1", rewarded)].into(),
            cut_off: episodes.iter().filter(|e| e.finish == "length").count(),
            generated_tokens: episodes.iter().map(|e| e.tokens).sum(),
            seconds,
            seed: options.seed,
            temperature: options.temperature,
            max_tokens: options.max_tokens,
        }
    }
}

impl std::fmt::Display for RolloutsSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} episodes, mean reward {:.3} (reward 1: {}, reward 0: {}), {} cut off by --max-tokens, {} tokens in {:.1} s",
            self.episodes,
            self.mean_reward,
            self.reward_counts["1"],
            self.reward_counts["0"],
            self.cut_off,
            self.generated_tokens,
            self.seconds
        )
    }
}

/// Operands are drawn from 1..=MAX_OPERAND.
const MAX_OPERAND: i64 = 20;

struct Problem {
    a: i64,
    op: char,
    b: i64,
}

impl Problem {
    fn draw(rng: &mut StdRng) -> Self {
        Self {
            a: rng.random_range(1..=MAX_OPERAND),
            op: ['+', '-', '*'][rng.random_range(0..3)],
            b: rng.random_range(1..=MAX_OPERAND),
        }
    }

    fn prompt(&self) -> String {
        format!(
            "What is {} {} {}? Reply with only the number.",
            self.a, self.op, self.b
        )
    }

    fn result(&self) -> i64 {
        match self.op {
            '+' => self.a + self.b,
            '-' => self.a - self.b,
            _ => self.a * self.b,
        }
    }
}

/// The last whole integer of a completion (a minus sign counts when it
/// does not follow a digit or letter); `None` when there is none, or when
/// the completion was cut off inside a number (`cut_off` and it ends in a
/// digit), whose last digits may be missing.
fn answer(completion: &str, cut_off: bool) -> Option<i64> {
    if cut_off && completion.ends_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let bytes = completion.as_bytes();
    let end = bytes.iter().rposition(u8::is_ascii_digit)? + 1;
    let mut start = end;
    while start > 0 && bytes[start - 1].is_ascii_digit() {
        start -= 1;
    }
    let negative = start > 0
        && bytes[start - 1] == b'-'
        && (start == 1 || !bytes[start - 2].is_ascii_alphanumeric());
    let magnitude: i64 = completion[start..end].parse().ok()?;
    Some(if negative { -magnitude } else { magnitude })
}

/// The text the model continues: the chat template applied to the prompt,
/// cut where the assistant's message would start.
fn generation_prefix(text: &TextSide, prompt: &str) -> Result<String> {
    const MARK: &str = "\u{1}qforge-completion\u{1}";
    let rendered = text.chat_text(prompt, MARK)?;
    let at = rendered.find(MARK).ok_or_else(|| {
        qforge_formats::Error::Unsupported(
            "the model's chat template drops the assistant's message".into(),
        )
    })?;
    Ok(rendered[..at].to_owned())
}

/// Generates `options.episodes` episodes with `lm`, calling `on_episode`
/// after each (for progress). Deterministic given the seed and the model.
pub fn rollouts(
    lm: &LanguageModel,
    options: &RolloutOptions,
    on_episode: &mut dyn FnMut(&Episode),
) -> Result<Vec<Episode>> {
    options.validate()?;
    let mut rng = StdRng::seed_from_u64(options.seed);
    let mut episodes = Vec::with_capacity(options.episodes);
    for index in 0..options.episodes {
        let problem = Problem::draw(&mut rng);
        let prompt = problem.prompt();
        let ids = lm
            .text
            .tokenizer
            .encode(&generation_prefix(&lm.text, &prompt)?)?;
        let generation = generate(
            lm,
            &ids,
            &GenerateOptions {
                max_tokens: options.max_tokens,
                temperature: Some(options.temperature),
                seed: rng.random(),
            },
        )?;
        let completion = lm.text.tokenizer.decode(&generation.tokens)?;
        // Generation ends early only at an end-of-sequence token.
        let cut_off = generation.tokens.len() == options.max_tokens;
        let correct = answer(&completion, cut_off) == Some(problem.result());
        let episode = Episode {
            prompt,
            completion,
            reward: if correct { 1.0 } else { 0.0 },
            episode_id: format!("{}-s{}-{index:05}", options.task.name(), options.seed),
            finish: if cut_off { "length" } else { "stop" },
            tokens: generation.tokens.len(),
        };
        on_episode(&episode);
        episodes.push(episode);
    }
    Ok(episodes)
}

/// Episodes as JSONL, a line each: the calibration data format.
pub fn jsonl(episodes: &[Episode]) -> String {
    let mut lines = String::new();
    for episode in episodes {
        lines.push_str(&serde_json::to_string(episode).expect("an episode serializes"));
        lines.push('\n');
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::answer;

    #[test]
    fn the_answer_is_the_last_whole_integer() {
        assert_eq!(answer("56", false), Some(56));
        assert_eq!(answer("7 * 8 = 56", false), Some(56));
        assert_eq!(answer("3 - 7 = -4.", false), Some(-4));
        assert_eq!(
            answer("3-7", false),
            Some(7),
            "a minus after a digit is an operator"
        );
        assert_eq!(
            answer("x-7", false),
            Some(7),
            "a minus after a letter is a hyphen"
        );
        assert_eq!(answer("The answer is 12, I think", true), Some(12));
        assert_eq!(answer("7 * 8 = 5", true), None, "cut off inside a number");
        assert_eq!(answer("no number", false), None);
        assert_eq!(answer("99999999999999999999", false), None);
    }
}
