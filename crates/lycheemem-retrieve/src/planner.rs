//! The planner (docs/algorithm.md, "Planning"): one LLM call turns the question into a typed
//! plan of routes. Parsing is lenient — an invalid type becomes `single`, limits are enforced by
//! truncation, temporal phrases ("on", "before"/"by", "after"/"since", relative expressions)
//! become ISO bounds — and an unusable reply falls back to one route carrying the question
//! itself.

use chrono::NaiveDate;
use lycheemem_core::config::RetrievalConfig;
use lycheemem_core::date::{CalendarDate, parse_date, resolve_date};
use lycheemem_core::{Constraint, Plan, QuestionType, Route, TemporalFilter, TokenUsage};
use lycheemem_llm::{ChatMessage, GenerateOptions, Llm};
use serde_json::{Value, json};

/// The planner's standing instructions. The examples are made up for this prompt (no benchmark
/// question is among them).
pub const PLANNER_INSTRUCTIONS: &str = "You plan memory retrieval for a question about past conversations.
Return one JSON object:
- question_type: what the question asks for.
  single: one fact (who, what, where, which). Example: \"What breed is Sam's dog?\"
  temporal: when something happened, how long ago or how long it lasted, or the order of events. Example: \"When did Sam adopt the dog?\"
  aggregate: a count, a total or a list gathered over several occasions. Example: \"How many concerts has Sam been to?\"
  comparison: two or more named things, people or times set against each other. Example: \"Which trip did Sam like more, Rome or Oslo?\"
  personalized_advice: a recommendation that fits the user's history. Example: \"Can you suggest a gift for my sister?\"
  prior_assistant_response: what the assistant itself said earlier. Example: \"What was the recipe you gave me?\"
  other: none of these.
- semantic_queries: short search queries that would match the stored memories.
- temporal_filter: {since, until} as ISO dates (YYYY-MM-DD) when the question is about a time period, else null. \"on DATE\" sets both; \"before/by DATE\" sets until; \"after/since DATE\" sets since. Resolve relative times against the reference date.
- routes: usually ONE route; several only when the question needs separate pieces of evidence (e.g. a comparison of two things). Each route: route_id, goal, queries, constraints (list of {kind, value}, e.g. {\"kind\": \"person\", \"value\": \"Sam\"}), temporal_filter.
Reply with the JSON object only.";

/// Changes whenever the planning call or the type rule changes in a way the instructions and
/// the schema do not show: part of the key under which the benchmark harness caches plans.
pub const PLANNER_REVISION: u32 = 2;

/// The types whose wording a question carries (docs/algorithm.md, "Planning": the type
/// cross-check), most specific first. Matching is on lowercased words and word pairs; a date in
/// the question or a bounded temporal filter also counts as a temporal cue.
pub fn question_type_cues(question: &str, has_date_bound: bool) -> Vec<QuestionType> {
    let lower = question.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_alphanumeric() && c != '\'')
        .filter(|w| !w.is_empty())
        .collect();
    let has = |w: &str| words.contains(&w);
    let pair = |a: &str, b: &str| words.windows(2).any(|p| p[0] == a && p[1] == b);
    let mut cues = Vec::new();
    let you_did = [
        "said",
        "told",
        "suggested",
        "recommended",
        "mentioned",
        "gave",
        "provided",
        "shared",
        "wrote",
        "listed",
    ];
    if you_did.iter().any(|v| pair("you", v))
        || has("your")
            && ["suggestion", "recommendation", "advice", "answer"]
                .iter()
                .any(|w| has(w))
    {
        cues.push(QuestionType::PriorAssistantResponse);
    }
    if ["recommend", "suggest", "advice", "advise", "tips", "ideas"]
        .iter()
        .any(|w| has(w))
        || pair("should", "i")
        || pair("could", "i")
        || pair("can", "i")
    {
        cues.push(QuestionType::PersonalizedAdvice);
    }
    let is_year = |w: &&str| {
        w.len() == 4
            && w.chars().all(|c| c.is_ascii_digit())
            && (w.starts_with("19") || w.starts_with("20"))
    };
    const MONTHS: [&str; 12] = [
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
    ];
    let temporal_words = [
        "when",
        "date",
        "dates",
        "year",
        "years",
        "month",
        "months",
        "week",
        "weeks",
        "day",
        "days",
        "ago",
        "before",
        "after",
        "since",
        "until",
        "earlier",
        "later",
        "recently",
        "yesterday",
        "today",
        "tomorrow",
        "first",
        "last",
        "time",
    ];
    if has_date_bound
        || temporal_words.iter().any(|w| has(w))
        || pair("how", "long")
        || words.iter().any(is_year)
        || MONTHS.iter().any(|m| *m != "may" && has(m))
    {
        cues.push(QuestionType::Temporal);
    }
    if pair("how", "many")
        || pair("how", "much")
        || pair("how", "often")
        || pair("number", "of")
        || ["total", "altogether", "list", "count", "every", "each"]
            .iter()
            .any(|w| has(w))
        || pair("all", "the")
    {
        cues.push(QuestionType::Aggregate);
    }
    if [
        "compare",
        "compared",
        "comparison",
        "difference",
        "differ",
        "versus",
        "vs",
        "than",
        "or",
        "both",
        "prefer",
        "better",
        "worse",
        "more",
        "less",
        "most",
        "least",
    ]
    .iter()
    .any(|w| has(w))
    {
        cues.push(QuestionType::Comparison);
    }
    cues
}

/// The type cross-check: a specialized type the planner gives stands when the question's
/// wording carries it; otherwise the most specific type the wording does carry wins, and a
/// question with no cue at all is `single` (or `other`, when the planner said so).
pub fn checked_question_type(planned: QuestionType, cues: &[QuestionType]) -> QuestionType {
    if cues.contains(&planned) {
        return planned;
    }
    match cues.first() {
        Some(&cued) => cued,
        None if planned == QuestionType::Other => QuestionType::Other,
        None => QuestionType::Single,
    }
}

/// The plan JSON Schema (constrained decoding locally, `response_format` remotely).
pub fn plan_schema(cfg: &RetrievalConfig) -> Value {
    let types: Vec<&str> = QuestionType::ALL.iter().map(|t| t.as_str()).collect();
    let date = json!({"type": ["string", "null"]});
    let filter = json!({
        "type": ["object", "null"],
        "properties": {"since": date, "until": date},
        "required": ["since", "until"],
        "additionalProperties": false
    });
    json!({
        "type": "object",
        "properties": {
            "question_type": {"enum": types},
            "semantic_queries": {"type": "array", "maxItems": cfg.max_queries, "items": {"type": "string"}},
            "temporal_filter": filter,
            "routes": {
                "type": "array",
                "minItems": 1,
                "maxItems": cfg.max_routes,
                "items": {
                    "type": "object",
                    "properties": {
                        "route_id": {"type": "string"},
                        "goal": {"type": "string"},
                        "queries": {"type": "array", "maxItems": cfg.max_queries_per_route, "items": {"type": "string"}},
                        "constraints": {
                            "type": "array",
                            "maxItems": cfg.max_constraints,
                            "items": {
                                "type": "object",
                                "properties": {"kind": {"type": "string"}, "value": {"type": "string"}},
                                "required": ["kind", "value"],
                                "additionalProperties": false
                            }
                        },
                        "temporal_filter": filter
                    },
                    "required": ["route_id", "goal", "queries", "constraints", "temporal_filter"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["question_type", "semantic_queries", "temporal_filter", "routes"],
        "additionalProperties": false
    })
}

/// A plan and how it was obtained.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOutcome {
    pub plan: Plan,
    /// Why the fallback plan was used, if it was.
    pub fallback: Option<String>,
    pub usage: Option<TokenUsage>,
}

/// The user message of the planning call.
pub fn planner_prompt(
    question: &str,
    context: &str,
    reference_date: Option<&str>,
    cfg: &RetrievalConfig,
) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "Reference date: {}\n",
        reference_date.unwrap_or("unknown")
    ));
    // The most recent part of the dialogue matters most: keep its tail.
    let context = context.trim();
    let skip = context
        .chars()
        .count()
        .saturating_sub(cfg.planner_context_chars);
    let context: String = context.chars().skip(skip).collect();
    if !context.is_empty() {
        out.push_str("Recent dialogue:\n");
        out.push_str(&context);
        out.push('\n');
    }
    out.push_str("Question: ");
    out.push_str(question.trim());
    out
}

/// Runs the planning call; never fails (an unusable reply or a failed call gives the fallback).
pub fn plan(
    llm: &dyn Llm,
    question: &str,
    context: &str,
    reference_date: Option<&str>,
    cfg: &RetrievalConfig,
    cancel: &lycheemem_core::Cancel,
) -> PlanOutcome {
    let messages = vec![
        ChatMessage::system(PLANNER_INSTRUCTIONS),
        ChatMessage::user(planner_prompt(question, context, reference_date, cfg)),
    ];
    let options = GenerateOptions {
        max_tokens: 512,
        temperature: 0.0,
        json_schema: Some(plan_schema(cfg)),
        cancel: cancel.clone(),
        ..Default::default()
    };
    match llm.complete(&messages, &options) {
        Ok(reply) => {
            let usage = TokenUsage {
                purpose: lycheemem_core::Purpose::Plan,
                model: reply.model.clone(),
                prompt_tokens: reply.prompt_tokens,
                completion_tokens: reply.completion_tokens,
                latency_ms: reply.latency_ms,
                estimated: reply.usage_estimated,
            };
            let (plan, fallback) = match parse_plan(&reply.text, question, reference_date, cfg) {
                Ok(p) => (p, None),
                Err(e) => (Plan::single_route(question), Some(e)),
            };
            PlanOutcome {
                plan,
                fallback,
                usage: Some(usage),
            }
        }
        Err(e) => PlanOutcome {
            plan: Plan::single_route(question),
            fallback: Some(format!("planner call failed: {e}")),
            usage: None,
        },
    }
}

fn strings(v: Option<&Value>, limit: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in v.and_then(Value::as_array).into_iter().flatten() {
        if let Some(s) = s.as_str().map(str::trim).filter(|s| !s.is_empty())
            && !out.iter().any(|o| o.eq_ignore_ascii_case(s))
            && out.len() < limit
        {
            out.push(s.to_string());
        }
    }
    out
}

/// One bound: an ISO date, a date with a leading "on/before/by/after/since", or a relative
/// expression resolved against the reference date. `(since, until)` it implies.
fn bound(text: &str, anchor: Option<NaiveDate>) -> Option<(Option<String>, Option<String>)> {
    let t = text.trim().to_ascii_lowercase();
    if t.is_empty() || t == "null" || t == "none" || t == "unknown" {
        return None;
    }
    let (kind, rest) = [
        "on ", "before ", "by ", "until ", "after ", "since ", "from ",
    ]
    .iter()
    .find_map(|p| t.strip_prefix(p).map(|r| (p.trim(), r)))
    .unwrap_or(("", t.as_str()));
    let date: CalendarDate = parse_date(rest)
        .map(|p| p.date)
        .or_else(|| anchor.and_then(|a| resolve_date(rest, a)))?;
    let (first, last) = (date.first_day().to_string(), date.last_day().to_string());
    Some(match kind {
        "before" | "by" | "until" => (None, Some(last)),
        "after" | "since" | "from" => (Some(first), None),
        _ => (Some(first), Some(last)),
    })
}

fn temporal_filter(v: Option<&Value>, anchor: Option<NaiveDate>) -> TemporalFilter {
    let Some(obj) = v.and_then(Value::as_object) else {
        return TemporalFilter::default();
    };
    let mut f = TemporalFilter::default();
    if let Some((since, until)) = obj
        .get("since")
        .and_then(Value::as_str)
        .and_then(|s| bound(s, anchor))
    {
        // A bare date in `since` means "from that day on".
        f.since = since.or(until.clone());
    }
    if let Some((since, until)) = obj
        .get("until")
        .and_then(Value::as_str)
        .and_then(|s| bound(s, anchor))
    {
        f.until = until.or(since);
    }
    if let (Some(a), Some(b)) = (&f.since, &f.until)
        && a > b
    {
        std::mem::swap(&mut f.since, &mut f.until);
    }
    f
}

/// Parses and bounds a planner reply. Errors only when there is no usable JSON object.
pub fn parse_plan(
    text: &str,
    question: &str,
    reference_date: Option<&str>,
    cfg: &RetrievalConfig,
) -> Result<Plan, String> {
    let t = text.trim();
    let value: Value = serde_json::from_str(t)
        .ok()
        .or_else(|| {
            let (a, b) = (t.find('{')?, t.rfind('}')?);
            (a < b)
                .then(|| serde_json::from_str(&t[a..=b]).ok())
                .flatten()
        })
        .ok_or_else(|| "the plan is not a JSON object".to_string())?;
    if !value.is_object() {
        return Err("the plan is not a JSON object".into());
    }
    let anchor = reference_date
        .and_then(parse_date)
        .map(|p| p.date.first_day());
    let planned_type = value
        .get("question_type")
        .and_then(Value::as_str)
        .map(QuestionType::parse_lenient)
        .unwrap_or_default();
    let semantic_queries = strings(value.get("semantic_queries"), cfg.max_queries);
    let plan_filter = temporal_filter(value.get("temporal_filter"), anchor);
    let mut routes = Vec::new();
    // The 16-query limit covers the routes' queries together (variants add question and goal).
    let mut total_queries = 0usize;
    for (i, r) in value
        .get("routes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .take(cfg.max_routes)
        .enumerate()
    {
        let mut queries = strings(r.get("queries"), cfg.max_queries_per_route);
        queries.truncate(cfg.max_queries.saturating_sub(total_queries));
        total_queries += queries.len();
        let goal = r
            .get("goal")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .unwrap_or(question)
            .to_string();
        let constraints = r
            .get("constraints")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let kind = c.get("kind")?.as_str()?.trim();
                let value = c.get("value")?.as_str()?.trim();
                (!kind.is_empty() && !value.is_empty()).then(|| Constraint {
                    kind: kind.to_string(),
                    value: value.to_string(),
                })
            })
            .take(cfg.max_constraints)
            .collect();
        let mut filter = temporal_filter(r.get("temporal_filter"), anchor);
        if filter.is_open() {
            filter = plan_filter.clone();
        }
        let route_id = r
            .get("route_id")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map_or_else(|| format!("r{}", i + 1), str::to_string);
        routes.push(Route {
            route_id,
            goal,
            queries,
            constraints,
            temporal_filter: filter,
        });
    }
    // Route ids must be unique: they key fusion.
    for i in 1..routes.len() {
        if routes[..i].iter().any(|r| r.route_id == routes[i].route_id) {
            routes[i].route_id = format!("{}#{}", routes[i].route_id, i + 1);
        }
    }
    if routes.is_empty() {
        let mut fallback = Plan::single_route(question);
        fallback.routes[0].queries.extend(
            semantic_queries
                .iter()
                .take(cfg.max_queries_per_route.saturating_sub(1))
                .cloned(),
        );
        fallback.routes[0].temporal_filter = plan_filter.clone();
        routes = fallback.routes;
    }
    let question_type = if cfg.question_type_cues {
        let bounded = !plan_filter.is_open() || routes.iter().any(|r| !r.temporal_filter.is_open());
        checked_question_type(planned_type, &question_type_cues(question, bounded))
    } else {
        planned_type
    };
    Ok(Plan {
        question_type,
        semantic_queries,
        temporal_filter: plan_filter,
        routes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> RetrievalConfig {
        RetrievalConfig::default()
    }

    #[test]
    fn a_good_plan_parses_with_bounds_resolved() {
        let reply = r#"{"question_type": "temporal", "semantic_queries": ["charity race"],
            "temporal_filter": {"since": "after 2023-05-01", "until": "before last week"},
            "routes": [{"route_id": "a", "goal": "when was the race", "queries": ["race", "race"],
              "constraints": [{"kind": "person", "value": "Caroline"}], "temporal_filter": null}]}"#;
        let p = parse_plan(
            reply,
            "When did Caroline run the race?",
            Some("2023-05-20"),
            &cfg(),
        )
        .unwrap();
        assert_eq!(p.question_type, QuestionType::Temporal);
        assert_eq!(p.temporal_filter.since.as_deref(), Some("2023-05-01"));
        // "last week" of 2023-05-20 is the week of 2023-05-08..14; "before" takes its end.
        assert!(p.temporal_filter.until.as_deref().unwrap() >= "2023-05-13");
        assert_eq!(p.routes.len(), 1);
        assert_eq!(p.routes[0].queries, vec!["race"]);
        assert_eq!(p.routes[0].constraints[0].value, "Caroline");
        assert_eq!(
            p.routes[0].temporal_filter, p.temporal_filter,
            "route inherits the plan filter"
        );
    }

    #[test]
    fn on_a_date_sets_both_bounds_and_months_span_the_month() {
        let f = temporal_filter(
            Some(&json!({"since": "on 7 May 2023", "until": null})),
            None,
        );
        assert_eq!(
            (f.since.as_deref(), f.until.as_deref()),
            (Some("2023-05-07"), None)
        );
        let (s, u) = bound("on 2023-05", None).unwrap();
        assert_eq!(
            (s.as_deref(), u.as_deref()),
            (Some("2023-05-01"), Some("2023-05-31"))
        );
        assert_eq!(bound("someday", None), None);
    }

    #[test]
    fn partial_and_invalid_plans_are_repaired() {
        let p = parse_plan(
            r#"{"question_type": "banana", "routes": []}"#,
            "Q?",
            None,
            &cfg(),
        )
        .unwrap();
        assert_eq!(p.question_type, QuestionType::Single);
        assert_eq!(p.routes.len(), 1);
        assert_eq!(p.routes[0].queries, vec!["Q?"]);
        // Too many routes and queries are truncated; duplicate ids made unique.
        let routes: Vec<Value> = (0..20)
            .map(|_| json!({"route_id": "x", "goal": "g", "queries": (0..20).map(|q| format!("q{q}")).collect::<Vec<_>>(), "constraints": [], "temporal_filter": null}))
            .collect();
        let reply =
            json!({"question_type": "comparison", "semantic_queries": [], "routes": routes})
                .to_string();
        let p = parse_plan(&reply, "Q?", None, &cfg()).unwrap();
        assert_eq!(p.routes.len(), 8);
        assert!(p.routes.iter().all(|r| r.queries.len() <= 8));
        assert!(p.routes.iter().map(|r| r.queries.len()).sum::<usize>() <= 16);
        let mut ids: Vec<&str> = p.routes.iter().map(|r| r.route_id.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 8);
    }

    #[test]
    fn a_type_stands_only_where_the_question_carries_it() {
        use QuestionType::*;
        let checked =
            |q: &str, planned| checked_question_type(planned, &question_type_cues(q, false));
        assert_eq!(checked("When did Sam adopt the dog?", Comparison), Temporal);
        assert_eq!(checked("How long has Sam lived in Oslo?", Single), Temporal);
        assert_eq!(checked("What breed is Sam's dog?", Comparison), Single);
        assert_eq!(checked("What breed is Sam's dog?", Other), Other);
        // Two cues: the planner's choice among them stands, else the more specific one.
        let q = "How many concerts did Sam go to last year?";
        assert_eq!(checked(q, Aggregate), Aggregate);
        assert_eq!(checked(q, Comparison), Temporal);
        assert_eq!(
            checked("Which trip did Sam like more, Rome or Oslo?", Comparison),
            Comparison
        );
        assert_eq!(
            checked("What was the recipe you gave me?", Single),
            PriorAssistantResponse
        );
        assert_eq!(
            checked("Can you suggest a gift for my sister?", Single),
            PersonalizedAdvice
        );
        // "May" is a verb as often as a month; a year is a date.
        assert_eq!(checked("What may Sam bring?", Temporal), Single);
        assert_eq!(checked("What did Sam bring in 2023?", Single), Temporal);
        assert_eq!(
            question_type_cues("What did Sam bring?", true),
            vec![Temporal]
        );
    }

    #[test]
    fn the_type_cross_check_runs_on_parsed_plans_unless_switched_off() {
        let reply = r#"{"question_type": "comparison", "semantic_queries": ["dog breed"],
            "temporal_filter": null, "routes": [{"route_id": "a", "goal": "breed", "queries": ["dog breed"],
              "constraints": [], "temporal_filter": null}]}"#;
        let p = parse_plan(reply, "What breed is Sam's dog?", None, &cfg()).unwrap();
        assert_eq!(p.question_type, QuestionType::Single);
        let dated = reply.replace(
            r#""temporal_filter": null, "routes""#,
            r#""temporal_filter": {"since": "2023-01-01", "until": null}, "routes""#,
        );
        let p = parse_plan(&dated, "What breed is Sam's dog?", None, &cfg()).unwrap();
        assert_eq!(
            p.question_type,
            QuestionType::Temporal,
            "a date bound is a temporal cue"
        );
        let off = RetrievalConfig {
            question_type_cues: false,
            ..cfg()
        };
        let p = parse_plan(reply, "What breed is Sam's dog?", None, &off).unwrap();
        assert_eq!(p.question_type, QuestionType::Comparison);
    }

    #[test]
    fn garbage_is_an_error_that_plan_turns_into_the_fallback() {
        assert!(parse_plan("I think you should search.", "Q?", None, &cfg()).is_err());
        assert!(parse_plan("[1,2]", "Q?", None, &cfg()).is_err());
    }
}
