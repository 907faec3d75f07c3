//! Retrieval plans produced by the planner (docs/algorithm.md, "Planning").

use serde::{Deserialize, Serialize};

/// What kind of question is being asked; selects the per-type retrieval budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuestionType {
    #[default]
    Single,
    Aggregate,
    Temporal,
    Comparison,
    PersonalizedAdvice,
    PriorAssistantResponse,
    Other,
}

impl QuestionType {
    pub const ALL: [QuestionType; 7] = [
        QuestionType::Single,
        QuestionType::Aggregate,
        QuestionType::Temporal,
        QuestionType::Comparison,
        QuestionType::PersonalizedAdvice,
        QuestionType::PriorAssistantResponse,
        QuestionType::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            QuestionType::Single => "single",
            QuestionType::Aggregate => "aggregate",
            QuestionType::Temporal => "temporal",
            QuestionType::Comparison => "comparison",
            QuestionType::PersonalizedAdvice => "personalized_advice",
            QuestionType::PriorAssistantResponse => "prior_assistant_response",
            QuestionType::Other => "other",
        }
    }

    /// Parses a planner-provided type; anything invalid is [`QuestionType::Single`]
    /// (docs/algorithm.md, "Planning").
    pub fn parse_lenient(s: &str) -> QuestionType {
        let norm = s.trim().to_ascii_lowercase().replace([' ', '-'], "_");
        QuestionType::ALL
            .into_iter()
            .find(|t| t.as_str() == norm)
            .unwrap_or_default()
    }
}

/// An inclusive ISO date range; either bound may be open.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemporalFilter {
    pub since: Option<String>,
    pub until: Option<String>,
}

impl TemporalFilter {
    pub fn is_open(&self) -> bool {
        self.since.is_none() && self.until.is_none()
    }
}

/// A non-embedded hint attached to a route (e.g. `{"kind": "person", "value": "Caroline"}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraint {
    pub kind: String,
    pub value: String,
}

/// One retrieval route: a goal with its own queries, constraints and time filter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Route {
    pub route_id: String,
    pub goal: String,
    pub queries: Vec<String>,
    pub constraints: Vec<Constraint>,
    pub temporal_filter: TemporalFilter,
}

/// The planner's output for one question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub question_type: QuestionType,
    pub semantic_queries: Vec<String>,
    pub temporal_filter: TemporalFilter,
    pub routes: Vec<Route>,
}

impl Plan {
    /// The fallback plan: one route whose only query is the question itself.
    pub fn single_route(question: &str) -> Plan {
        Plan {
            question_type: QuestionType::Single,
            semantic_queries: vec![question.to_string()],
            temporal_filter: TemporalFilter::default(),
            routes: vec![Route {
                route_id: "r1".into(),
                goal: question.to_string(),
                queries: vec![question.to_string()],
                constraints: Vec::new(),
                temporal_filter: TemporalFilter::default(),
            }],
        }
    }
}
