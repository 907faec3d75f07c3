//! Date parsing and normalization for every date format found in the benchmarks and in LLM
//! output, into ISO day (`YYYY-MM-DD`) and month (`YYYY-MM`) keys.
//!
//! Accepted (case-insensitive, surrounding whitespace ignored):
//! - ISO: `2023-05-08`, `2023-05`, `2023-05-08T13:56:00Z`, `2023-05-08 13:56`
//! - LongMemEval: `2023/05/30 (Tue) 23:40`, `2023/05/30`
//! - LoCoMo: `1:56 pm on 8 May, 2023`
//! - `May 8, 2023`, `May 8th 2023`, `Sept 8, 2023`
//! - `8 May 2023`, `8 May, 2023`, `8th of May 2023`
//! - `May 2023`

use chrono::{NaiveDate, NaiveDateTime, NaiveTime};
use regex::Regex;
use serde::Serialize;
use std::sync::LazyLock;

/// A calendar date at day or month precision. Made by the parsers here, which accept months
/// 1–12 of years 1–9999 only (what `first_day` and `last_day` rely on); not deserialized, so
/// no data can hold another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum CalendarDate {
    Day(NaiveDate),
    Month { year: i32, month: u32 },
}

impl CalendarDate {
    /// `YYYY-MM-DD` or `YYYY-MM`.
    pub fn iso(&self) -> String {
        match self {
            CalendarDate::Day(d) => d.format("%Y-%m-%d").to_string(),
            CalendarDate::Month { year, month } => format!("{year:04}-{month:02}"),
        }
    }

    /// `day:YYYY-MM-DD`, only for day-precision dates.
    pub fn day_key(&self) -> Option<String> {
        match self {
            CalendarDate::Day(d) => Some(format!("day:{}", d.format("%Y-%m-%d"))),
            CalendarDate::Month { .. } => None,
        }
    }

    /// `month:YYYY-MM`.
    pub fn month_key(&self) -> String {
        let (year, month) = self.year_month();
        format!("month:{year:04}-{month:02}")
    }

    pub fn year_month(&self) -> (i32, u32) {
        use chrono::Datelike;
        match *self {
            CalendarDate::Day(d) => (d.year(), d.month()),
            CalendarDate::Month { year, month } => (year, month),
        }
    }

    /// First day covered.
    pub fn first_day(&self) -> NaiveDate {
        match *self {
            CalendarDate::Day(d) => d,
            CalendarDate::Month { year, month } => {
                NaiveDate::from_ymd_opt(year, month, 1).expect("validated month")
            }
        }
    }

    /// Last day covered.
    pub fn last_day(&self) -> NaiveDate {
        match *self {
            CalendarDate::Day(d) => d,
            CalendarDate::Month { year, month } => {
                let (ny, nm) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                NaiveDate::from_ymd_opt(ny, nm, 1)
                    .expect("validated month")
                    .pred_opt()
                    .expect("not min date")
            }
        }
    }
}

/// A parsed date with its time of day when the input had one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParsedDate {
    pub date: CalendarDate,
    pub time: Option<NaiveTime>,
}

impl ParsedDate {
    /// ISO date-time (`YYYY-MM-DDTHH:MM:SS`) when day and time are known, else the ISO date.
    pub fn iso(&self) -> String {
        match (self.date, self.time) {
            (CalendarDate::Day(d), Some(t)) => NaiveDateTime::new(d, t)
                .format("%Y-%m-%dT%H:%M:%S")
                .to_string(),
            _ => self.date.iso(),
        }
    }
}

const MONTH: &str = r"(jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?";

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).expect("static date regex")
}

static ISO: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)^(\d{4})-(\d{1,2})(?:-(\d{1,2}))?(?:[t ](\d{1,2}):(\d{2})(?::(\d{2})(?:\.\d+)?)?(?:z|[+-]\d{2}:?\d{2})?)?$",
    )
});
static SLASH: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?i)^(\d{4})/(\d{1,2})/(\d{1,2})(?:\s*\([a-z]+\))?(?:\s+(\d{1,2}):(\d{2}))?$")
});
static LOCOMO: LazyLock<Regex> = LazyLock::new(|| {
    re(&format!(
        r"(?i)^(\d{{1,2}}):(\d{{2}})\s*([ap])\.?m\.?\s+on\s+(\d{{1,2}})\s+{MONTH},?\s+(\d{{4}})$"
    ))
});
static MONTH_DAY_YEAR: LazyLock<Regex> = LazyLock::new(|| {
    re(&format!(
        r"(?i)^{MONTH}\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(\d{{4}})$"
    ))
});
static DAY_MONTH_YEAR: LazyLock<Regex> = LazyLock::new(|| {
    re(&format!(
        r"(?i)^(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?{MONTH},?\s+(\d{{4}})$"
    ))
});
static MONTH_YEAR: LazyLock<Regex> = LazyLock::new(|| re(&format!(r"(?i)^{MONTH},?\s+(\d{{4}})$")));

/// Scanners for dates inside free text (word-bounded, unanchored).
static SCAN_DAY: LazyLock<Regex> = LazyLock::new(|| {
    re(&format!(
        r"(?i)\b(?:\d{{4}}-\d{{1,2}}-\d{{1,2}}|\d{{4}}/\d{{1,2}}/\d{{1,2}}|{MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}|\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{MONTH},?\s+\d{{4}})\b"
    ))
});
static SCAN_MONTH: LazyLock<Regex> = LazyLock::new(|| {
    re(&format!(
        r"(?i)\b(?:\d{{4}}-\d{{1,2}}|{MONTH},?\s+\d{{4}})\b"
    ))
});

fn month_number(name: &str) -> Option<u32> {
    let n = name.to_ascii_lowercase();
    let idx = [
        "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
    ]
    .iter()
    .position(|m| n.starts_with(m))?;
    Some(idx as u32 + 1)
}

fn num<T: std::str::FromStr>(s: Option<regex::Match<'_>>) -> Option<T> {
    s?.as_str().parse().ok()
}

fn day(year: i32, month: u32, d: u32) -> Option<CalendarDate> {
    NaiveDate::from_ymd_opt(year, month, d).map(CalendarDate::Day)
}

fn month(year: i32, month: u32) -> Option<CalendarDate> {
    ((1..=12).contains(&month) && (1..=9999).contains(&year))
        .then_some(CalendarDate::Month { year, month })
}

fn time(h: Option<u32>, m: Option<u32>, s: Option<u32>) -> Option<Option<NaiveTime>> {
    match (h, m) {
        (Some(h), Some(m)) => NaiveTime::from_hms_opt(h, m, s.unwrap_or(0)).map(Some),
        _ => Some(None),
    }
}

/// Parses one date (optionally with a time of day) in any accepted format.
/// Returns `None` for anything else, including impossible dates such as `2023-02-30`.
pub fn parse_date(input: &str) -> Option<ParsedDate> {
    let s = input.trim();
    if let Some(c) = ISO.captures(s) {
        let (y, m) = (num(c.get(1))?, num(c.get(2))?);
        let date = match c.get(3) {
            Some(d) => day(y, m, d.as_str().parse().ok()?)?,
            None => month(y, m)?,
        };
        let time = time(num(c.get(4)), num(c.get(5)), num(c.get(6)))?;
        if time.is_some() && matches!(date, CalendarDate::Month { .. }) {
            return None;
        }
        return Some(ParsedDate { date, time });
    }
    if let Some(c) = SLASH.captures(s) {
        let date = day(num(c.get(1))?, num(c.get(2))?, num(c.get(3))?)?;
        return Some(ParsedDate {
            date,
            time: time(num(c.get(4)), num(c.get(5)), None)?,
        });
    }
    if let Some(c) = LOCOMO.captures(s) {
        let (h12, minute): (u32, u32) = (num(c.get(1))?, num(c.get(2))?);
        if !(1..=12).contains(&h12) {
            return None;
        }
        let pm = c[3].eq_ignore_ascii_case("p");
        let hour = h12 % 12 + if pm { 12 } else { 0 };
        let date = day(num(c.get(6))?, month_number(&c[5])?, num(c.get(4))?)?;
        return Some(ParsedDate {
            date,
            time: Some(NaiveTime::from_hms_opt(hour, minute, 0)?),
        });
    }
    if let Some(c) = MONTH_DAY_YEAR.captures(s) {
        let date = day(num(c.get(3))?, month_number(&c[1])?, num(c.get(2))?)?;
        return Some(ParsedDate { date, time: None });
    }
    if let Some(c) = DAY_MONTH_YEAR.captures(s) {
        let date = day(num(c.get(3))?, month_number(&c[2])?, num(c.get(1))?)?;
        return Some(ParsedDate { date, time: None });
    }
    if let Some(c) = MONTH_YEAR.captures(s) {
        return Some(ParsedDate {
            date: month(num(c.get(2))?, month_number(&c[1])?)?,
            time: None,
        });
    }
    None
}

/// Normalizes a date string to ISO (`YYYY-MM-DD` or `YYYY-MM`), dropping any time of day.
pub fn normalize_date(input: &str) -> Option<String> {
    parse_date(input).map(|p| p.date.iso())
}

/// Every date mentioned in free text, in order of appearance, without duplicates. Day-precision
/// mentions win over a month mention they contain.
pub fn find_dates(text: &str) -> Vec<CalendarDate> {
    let mut found: Vec<(usize, CalendarDate)> = Vec::new();
    let mut covered: Vec<(usize, usize)> = Vec::new();
    for m in SCAN_DAY.find_iter(text) {
        if let Some(p) = parse_date(m.as_str()) {
            found.push((m.start(), p.date));
            covered.push((m.start(), m.end()));
        }
    }
    for m in SCAN_MONTH.find_iter(text) {
        let inside = covered.iter().any(|&(a, b)| m.start() < b && a < m.end());
        if !inside && let Some(p) = parse_date(m.as_str()) {
            found.push((m.start(), p.date));
        }
    }
    found.sort_by_key(|&(pos, _)| pos);
    let mut out: Vec<CalendarDate> = Vec::new();
    for (_, d) in found {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Resolves a date expression against an anchor day (the session date): absolute dates parse
/// as in [`parse_date`]; relative ones — `today`, `yesterday`, `tomorrow`, `N days/weeks ago`,
/// `last/next week|month|year`, `this week|month|year` — become days or months relative to the
/// anchor. `None` when the expression is neither.
pub fn resolve_date(expr: &str, anchor: NaiveDate) -> Option<CalendarDate> {
    if let Some(p) = parse_date(expr) {
        return Some(p.date);
    }
    let e = expr.trim().to_ascii_lowercase();
    let e = e.trim_end_matches('.');
    // Counts come from free text ("200000000000 days ago"): every step is checked, and a date
    // outside what a calendar day can hold is no date at all (never a panic or an overflow).
    let days = |n: i64| {
        chrono::Duration::try_days(n)
            .and_then(|d| anchor.checked_add_signed(d))
            .map(CalendarDate::Day)
    };
    let month_shift = |delta: i64| {
        use chrono::Datelike;
        let total = i64::from(anchor.year()) * 12 + i64::from(anchor.month0());
        let total = total.checked_add(delta)?;
        month(
            i32::try_from(total.div_euclid(12)).ok()?,
            total.rem_euclid(12) as u32 + 1,
        )
    };
    match e {
        "today" | "tonight" | "this morning" | "this afternoon" | "this evening" | "now" => {
            return days(0);
        }
        "yesterday" | "last night" => return days(-1),
        "the day before yesterday" => return days(-2),
        "tomorrow" => return days(1),
        "the day after tomorrow" => return days(2),
        "last week" => return days(-7),
        "next week" => return days(7),
        "this week" => return days(0),
        "last month" => return month_shift(-1),
        "next month" => return month_shift(1),
        "this month" => return month_shift(0),
        "last year" | "next year" | "this year" => {
            use chrono::Datelike;
            let y = anchor.year()
                + if e.starts_with("last") {
                    -1
                } else if e.starts_with("next") {
                    1
                } else {
                    0
                };
            return month(y, anchor.month());
        }
        _ => {}
    }
    static AGO: LazyLock<Regex> = LazyLock::new(|| {
        re(
            r"^(\d+|a|an|one|two|three|four|five|six|seven)\s+(day|week|month|year)s?\s+(ago|later|from now)$",
        )
    });
    let c = AGO.captures(e)?;
    let n: i64 = match &c[1] {
        "a" | "an" | "one" => 1,
        "two" => 2,
        "three" => 3,
        "four" => 4,
        "five" => 5,
        "six" => 6,
        "seven" => 7,
        digits => digits.parse().ok()?,
    };
    let n = if &c[3] == "ago" { n.checked_neg()? } else { n };
    match &c[2] {
        "day" => days(n),
        "week" => days(n.checked_mul(7)?),
        "month" => month_shift(n),
        _ => month_shift(n.checked_mul(12)?),
    }
}

/// The first relative time phrase in free text (`yesterday`, `last week`, `3 days ago`, ...)
/// with its byte span and its resolution against `anchor`.
pub fn find_relative(
    text: &str,
    anchor: NaiveDate,
) -> Option<(std::ops::Range<usize>, CalendarDate)> {
    static RELATIVE: LazyLock<Regex> = LazyLock::new(|| {
        re(
            r"(?i)\b(the day before yesterday|the day after tomorrow|yesterday|last night|tomorrow|today|tonight|(?:last|next|this) (?:week|month|year)|(?:\d+|a|an|one|two|three|four|five|six|seven) (?:day|week|month|year)s? (?:ago|later|from now))\b",
        )
    });
    RELATIVE
        .find_iter(text)
        .find_map(|m| resolve_date(m.as_str(), anchor).map(|d| (m.range(), d)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn finds_relative_phrases_in_text() {
        let anchor = NaiveDate::from_ymd_opt(2023, 5, 8).unwrap();
        let text = "Caroline went to the support group yesterday and will go again next month.";
        let (span, date) = find_relative(text, anchor).unwrap();
        assert_eq!(&text[span], "yesterday");
        assert_eq!(date.iso(), "2023-05-07");
        assert_eq!(
            find_relative("Three weeks ago we met.", anchor)
                .map(|(_, d)| d.iso())
                .as_deref(),
            Some("2023-04-17")
        );
        assert!(find_relative("No time words here.", anchor).is_none());
    }

    #[test]
    fn relative_dates_resolve_against_the_anchor() {
        let anchor = NaiveDate::from_ymd_opt(2023, 5, 8).unwrap();
        let iso = |e: &str| resolve_date(e, anchor).map(|d| d.iso());
        assert_eq!(iso("yesterday").as_deref(), Some("2023-05-07"));
        assert_eq!(iso("Today").as_deref(), Some("2023-05-08"));
        assert_eq!(iso("tomorrow").as_deref(), Some("2023-05-09"));
        assert_eq!(iso("3 days ago").as_deref(), Some("2023-05-05"));
        assert_eq!(iso("two weeks ago").as_deref(), Some("2023-04-24"));
        assert_eq!(iso("last week").as_deref(), Some("2023-05-01"));
        assert_eq!(iso("last month").as_deref(), Some("2023-04"));
        assert_eq!(iso("next month").as_deref(), Some("2023-06"));
        assert_eq!(iso("last year").as_deref(), Some("2022-05"));
        assert_eq!(iso("2 months ago").as_deref(), Some("2023-03"));
        assert_eq!(iso("8 May 2023").as_deref(), Some("2023-05-08"));
        assert_eq!(iso("someday"), None);
        let january = NaiveDate::from_ymd_opt(2024, 1, 15).unwrap();
        assert_eq!(
            resolve_date("last month", january)
                .map(|d| d.iso())
                .as_deref(),
            Some("2023-12")
        );
    }

    fn iso(s: &str) -> Option<String> {
        parse_date(s).map(|p| p.iso())
    }

    #[test]
    fn benchmark_formats() {
        assert_eq!(
            iso("1:56 pm on 8 May, 2023").as_deref(),
            Some("2023-05-08T13:56:00")
        );
        assert_eq!(
            iso("12:09 am on 13 August, 2023").as_deref(),
            Some("2023-08-13T00:09:00")
        );
        assert_eq!(
            iso("12:30 PM on 1 Jan 2024").as_deref(),
            Some("2024-01-01T12:30:00")
        );
        assert_eq!(
            iso("2023/05/30 (Tue) 23:40").as_deref(),
            Some("2023-05-30T23:40:00")
        );
        assert_eq!(iso("2023/05/30").as_deref(), Some("2023-05-30"));
        assert_eq!(iso("2023-05-08").as_deref(), Some("2023-05-08"));
        assert_eq!(
            iso("2023-05-08T13:56:00Z").as_deref(),
            Some("2023-05-08T13:56:00")
        );
        assert_eq!(iso("2023-05").as_deref(), Some("2023-05"));
        assert_eq!(iso("May 8, 2023").as_deref(), Some("2023-05-08"));
        assert_eq!(iso("Sept 8th, 2023").as_deref(), Some("2023-09-08"));
        assert_eq!(iso("8 May 2023").as_deref(), Some("2023-05-08"));
        assert_eq!(iso(" 8th of may, 2023 ").as_deref(), Some("2023-05-08"));
        assert_eq!(iso("May 2023").as_deref(), Some("2023-05"));
    }

    #[test]
    fn rejects_impossible_and_unknown() {
        for bad in [
            "2023-02-30",
            "2023-13",
            "13:00 pm on 8 May, 2023",
            "yesterday",
            "",
            "May",
            "32 May 2023",
        ] {
            assert_eq!(parse_date(bad), None, "{bad}");
        }
    }

    #[test]
    fn keys() {
        let d = parse_date("8 May 2023").unwrap().date;
        assert_eq!(d.day_key().as_deref(), Some("day:2023-05-08"));
        assert_eq!(d.month_key(), "month:2023-05");
        let m = parse_date("2024-02").unwrap().date;
        assert_eq!(m.day_key(), None);
        assert_eq!(m.last_day().to_string(), "2024-02-29");
    }

    #[test]
    fn finds_dates_in_text() {
        let found =
            find_dates("Moved on May 8, 2023, left 2023-06-01; trip in July 2023 and 3 Aug 2023.");
        let isos: Vec<String> = found.iter().map(CalendarDate::iso).collect();
        assert_eq!(isos, ["2023-05-08", "2023-06-01", "2023-07", "2023-08-03"]);
        assert!(find_dates("no dates here, just 42 things").is_empty());
    }

    #[test]
    fn absurd_relative_counts_are_no_date_not_a_panic() {
        let anchor = NaiveDate::from_ymd_opt(2023, 5, 8).unwrap();
        for expr in [
            "200000000000 days ago",
            "200000000000 weeks ago",
            "9223372036854775807 days later",
            "9223372036854775807 weeks from now",
            "9223372036854775807 months ago",
            "9223372036854775807 years ago",
            "99999999999999999999999 days ago",
            "3000000 months later",
            "20000 years ago",
        ] {
            assert_eq!(resolve_date(expr, anchor), None, "{expr}");
        }
        assert!(find_relative("I visited Paris 200000000000 days ago.", anchor).is_none());
        // Edge of the calendar: still a date when it exists.
        assert_eq!(
            resolve_date("2 years later", anchor),
            Some(CalendarDate::Month {
                year: 2025,
                month: 5
            })
        );
    }

    proptest! {
        #[test]
        fn relative_phrases_never_panic(n in any::<u64>(), unit in 0usize..4, dir in 0usize..3,
                                        y in 1i32..9999, m in 1u32..=12, d in 1u32..=28) {
            let anchor = NaiveDate::from_ymd_opt(y, m, d).unwrap();
            let unit = ["day", "week", "month", "year"][unit];
            let dir = ["ago", "later", "from now"][dir];
            let phrase = format!("{n} {unit}s {dir}");
            let _ = resolve_date(&phrase, anchor);
            let _ = find_relative(&format!("We met {phrase}."), anchor);
        }

        #[test]
        fn every_format_agrees(y in 1900i32..2100, m in 1u32..=12, d in 1u32..=28, h in 0u32..24, min in 0u32..60) {
            let date = NaiveDate::from_ymd_opt(y, m, d).unwrap();
            let name = date.format("%B").to_string();
            let short = date.format("%b").to_string();
            let h12 = if h % 12 == 0 { 12 } else { h % 12 };
            let ampm = if h < 12 { "am" } else { "pm" };
            let expected = date.format("%Y-%m-%d").to_string();
            for s in [
                format!("{y:04}-{m:02}-{d:02}"),
                format!("{y:04}/{m:02}/{d:02} (Mon) {h:02}:{min:02}"),
                format!("{h12}:{min:02} {ampm} on {d} {name}, {y}"),
                format!("{name} {d}, {y}"),
                format!("{short} {d} {y}"),
                format!("{d} {name} {y}"),
            ] {
                prop_assert_eq!(normalize_date(&s), Some(expected.clone()), "{}", s);
            }
            let locomo = parse_date(&format!("{h12}:{min:02} {ampm} on {d} {name}, {y}")).unwrap();
            prop_assert_eq!(locomo.time, NaiveTime::from_hms_opt(h, min, 0));
        }

        #[test]
        fn normalize_is_idempotent(s in "\\PC{0,30}") {
            if let Some(n) = normalize_date(&s) {
                prop_assert_eq!(normalize_date(&n), Some(n.clone()));
            }
        }
    }
}
