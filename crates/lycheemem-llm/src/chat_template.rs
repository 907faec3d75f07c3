//! Renders chat prompts with the model's own `tokenizer.chat_template` (Jinja, via minijinja
//! with Python-compatible string methods), never a hand-written template.

use lycheemem_core::{Error, Result};
use minijinja::{Environment, ErrorKind, context};
use serde::Serialize;

use crate::ChatMessage;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

#[derive(Serialize)]
struct Msg<'a> {
    role: &'a str,
    content: &'a str,
}

impl ChatTemplate {
    /// Compiles `source` (the GGUF's `tokenizer.chat_template`).
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                Error::Model(format!("the model's chat template does not compile: {e}"))
            })?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The prompt text for `messages`, ending with the assistant turn's opening.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String> {
        let msgs: Vec<Msg<'_>> = messages
            .iter()
            .map(|m| Msg {
                role: m.role.as_str(),
                content: &m.content,
            })
            .collect();
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Model(e.to_string()))?;
        tmpl.render(context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| Error::InvalidInput(format!("chat template rejected the messages: {e}")))
    }
}
