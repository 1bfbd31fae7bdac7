//! The text side of a language model: its tokenizer and chat template, read
//! from a GGUF header or a Hugging Face directory, and the rendering of a
//! conversation into a prompt whose messages cannot open or close a turn.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::llama_config::LlamaConfig;
use crate::tokenizer::TextTokenizer;

/// What turns text into token ids: the tokenizer and the chat template.
/// Loading it reads no weights, so a coordinator can plan a calibration
/// without holding the model in memory.
#[derive(Debug, Clone)]
pub struct TextSide {
    /// The tokenizer.
    pub tokenizer: TextTokenizer,
    /// The chat template (Jinja), when the model ships one.
    pub chat_template: Option<String>,
}

impl TextSide {
    /// Whether `other` tokenizes and templates text exactly as this does.
    pub fn same_as(&self, other: &TextSide) -> bool {
        self.chat_template == other.chat_template && self.tokenizer.same_as(&other.tokenizer)
    }

    /// The tokenizer and chat template of a GGUF file or a Hugging Face
    /// directory (`config.json`, `tokenizer.json`, `tokenizer_config.json`).
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let config_path = path.join("config.json");
            let json: serde_json::Value = crate::files::read_json(&config_path)?;
            let c = LlamaConfig::from_hf(&json).map_err(|e| e.in_file(&config_path))?;
            Self::from_hf_dir(path, &c)
        } else {
            Self::from_gguf(&GgufFile::open(path)?, path)
        }
    }

    /// The tokenizer and chat template of the Hugging Face directory `dir`,
    /// whose `config.json` is `c`. A directory without `tokenizer.json` (nothing at that path, not even a
    /// broken link) gives a tokenizer that takes token ids only.
    pub fn from_hf_dir(dir: &Path, c: &LlamaConfig) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let (bos, add_bos, eos) = (c.bos_token_id, hf_adds_bos(dir)?, c.eos_token_ids.clone());
        let tokenizer = match path.symlink_metadata() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                TextTokenizer::ids_only(&path, c.vocab_size, bos, add_bos, eos)
            }
            _ => TextTokenizer::from_file(&path, bos, add_bos, eos)?,
        };
        let chat_template =
            tokenizer_config(dir)?.and_then(|j| j["chat_template"].as_str().map(str::to_owned));
        Ok(Self {
            tokenizer,
            chat_template,
        })
    }

    /// The tokenizer and chat template in the header of the GGUF `file`,
    /// read from `path`.
    pub fn from_gguf(file: &GgufFile, path: &Path) -> Result<Self> {
        let tokenizer = TextTokenizer::from_gguf(&file.header).map_err(|e| e.in_file(path))?;
        let chat_template = file
            .header
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        Ok(Self {
            tokenizer,
            chat_template,
        })
    }

    /// Renders a prompt and a completion as one conversation with the model's
    /// chat template (a user turn and an assistant turn), or concatenates them
    /// when the model has no template.
    pub fn chat_text(&self, prompt: &str, completion: &str) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Ok(format!("{prompt}{completion}"));
        };
        let messages = [
            ChatMessage {
                role: "user".into(),
                content: prompt.into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: completion.into(),
            },
        ];
        self.render_chat(template, &messages, false)
    }

    /// The prompt that asks the model for the next assistant turn after
    /// `messages`, rendered with its chat template: text to show, not to
    /// tokenize, since a special token's string in a message would read as
    /// that token ([`Self::chat_prompt_ids`] tokenizes it safely).
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Err(Error::Unsupported(
                "the model has no chat template; send plain text to /v1/completions".into(),
            ));
        };
        self.render_chat(template, messages, true)
    }

    /// The token ids of [`Self::chat_prompt`], with every message's content
    /// read as plain text: a special token's string in it (`<|im_end|>`)
    /// stays the characters it is made of, so no message can open or close
    /// a turn of another role. Only the roles `system`, `user` and
    /// `assistant` are taken.
    ///
    /// The template is rendered with each content between two
    /// noncharacters, which mark where the contents lie in the rendered
    /// text and are then taken out; the text is tokenized as one, special
    /// tokens recognised only outside those spans. A conversation whose
    /// messages spell no special token gets the ids its rendered text gets.
    pub fn chat_prompt_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        for message in messages {
            if !CHAT_ROLES.contains(&message.role.as_str()) {
                return Err(Error::Request(format!(
                    "role {:?} is not one of {}",
                    message.role,
                    CHAT_ROLES.join(", ")
                )));
            }
            if message.content.contains([MARK_START, MARK_END]) {
                return Err(Error::Request(
                    "a message holds the noncharacter U+FDD0 or U+FDD1, which chat prompts reserve"
                        .into(),
                ));
            }
        }
        let marked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role.clone(),
                content: format!("{MARK_START}{}{MARK_END}", m.content),
            })
            .collect();
        let rendered = self.chat_prompt(&marked)?;
        let mut text = String::with_capacity(rendered.len());
        let mut contents = Vec::new();
        let mut rest = rendered.as_str();
        while let Some((markup, marked)) = rest.split_once(MARK_START) {
            text.push_str(markup);
            let (content, after) = marked
                .split_once(MARK_END)
                .ok_or_else(|| Error::Format("chat template: it cut a message's content".into()))?;
            contents.push(text.len()..text.len() + content.len());
            text.push_str(content);
            rest = after;
        }
        if rest.contains(MARK_END) {
            return Err(Error::Format(
                "chat template: it cut a message's content".into(),
            ));
        }
        text.push_str(rest);
        let mut ids = self.tokenizer.bos_ids();
        ids.extend(self.tokenizer.encode_with_plain(&text, &contents)?);
        Ok(ids)
    }

    fn render_chat(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut env = minijinja::Environment::new();
        env.add_template("chat", template)
            .map_err(|e| Error::Format(format!("chat template: {e}")))?;
        let token = |id: Option<u32>| {
            id.and_then(|i| self.tokenizer.decode(&[i]).ok())
                .unwrap_or_default()
        };
        let messages: Vec<_> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role, content => m.content })
            .collect();
        let context = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => token(self.tokenizer.bos),
            eos_token => token(self.tokenizer.eos.first().copied()),
        };
        env.get_template("chat")
            .and_then(|t| t.render(context))
            .map_err(|e| Error::Format(format!("chat template: {e}")))
    }
}

/// The roles a chat message may have.
const CHAT_ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Noncharacters around a message's index where the chat template puts its
/// content (see [`TextSide::chat_prompt_ids`]).
const MARK_START: char = '\u{FDD0}';
const MARK_END: char = '\u{FDD1}';

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

/// A Hugging Face directory's `tokenizer_config.json`: `None` when it is
/// absent or not JSON (it is optional, and only a few of its keys are read);
/// a file that cannot be read (not a regular file, too large) is an error.
fn tokenizer_config(dir: &Path) -> Result<Option<serde_json::Value>> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    Ok(serde_json::from_slice(&crate::files::read_config(&path)?).ok())
}

/// Whether a Hugging Face tokenizer config asks for BOS.
fn hf_adds_bos(dir: &Path) -> Result<bool> {
    Ok(tokenizer_config(dir)?
        .and_then(|j| j["add_bos_token"].as_bool())
        .unwrap_or(false))
}
