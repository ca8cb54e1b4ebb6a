//! Listing as RabbitMQ's management API does: filtering by `name` (a
//! case-insensitive substring, or a regular expression with `use_regex=true`), sorting
//! (`sort`, a field or dotted path, `sort_reverse`), pagination (`page`,
//! `page_size` ≤ 500; the answer is then an object with `items`, `page`,
//! `page_count`, `page_size`, `item_count`, `filtered_count`,
//! `total_count`) and `columns` (keep only these fields, dotted paths).
//!
//! Cheap at scale: items are filtered and sorted on what they keep without
//! building JSON (names; counts read from atomics), and only the requested
//! page is rendered. Sorting on another field renders every item first.

use std::cmp::Ordering;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::http::error::ApiError;

/// The largest `page_size`, as RabbitMQ.
pub const MAX_PAGE_SIZE: u64 = 500;

/// Query parameters of a listing.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// 1-based page; paginates when present.
    pub page: Option<String>,
    /// Items per page (default 100, at most 500).
    pub page_size: Option<String>,
    /// Name filter.
    pub name: Option<String>,
    /// `name` is a regular expression.
    pub use_regex: Option<String>,
    /// Field (or dotted path) to sort by.
    pub sort: Option<String>,
    /// Reverse the order.
    pub sort_reverse: Option<String>,
    /// Comma-separated fields (dotted paths) to keep.
    pub columns: Option<String>,
    /// `disable_stats` and `lengths_age` etc. are accepted and ignored.
    #[serde(flatten)]
    pub _rest: std::collections::HashMap<String, String>,
}

fn truthy(v: &Option<String>) -> bool {
    v.as_deref().is_some_and(|s| s == "true" || s == "1")
}

/// A cheap sort key.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub enum Key {
    /// A number.
    Num(f64),
    /// A string.
    Str(String),
}

/// An item that can be listed.
pub trait Listable {
    /// The name the `name` filter looks at.
    fn name(&self) -> &str;
    /// The default order (e.g. vhost then name), borrowed: sorting 100,000
    /// items allocates nothing.
    fn default_key(&self) -> (&str, &str);
    /// A sort key for `field` without rendering, if this kind has it cheap.
    fn cheap_key(&self, _field: &str) -> Option<Key> {
        None
    }
    /// The item as JSON.
    fn render(&self) -> Value;
}

/// Filters, sorts, paginates and renders `items`.
pub fn list<T: Listable>(q: &ListQuery, mut items: Vec<T>) -> Result<Value, ApiError> {
    let total = items.len() as u64;
    if let Some(filter) = q.name.as_deref().filter(|f| !f.is_empty()) {
        if truthy(&q.use_regex) {
            let re = regex::RegexBuilder::new(filter)
                .size_limit(1 << 20)
                .build()
                .map_err(|e| ApiError::bad_request(format!("invalid regex: {e}")))?;
            items.retain(|i| re.is_match(i.name()));
        } else {
            let f = filter.as_bytes();
            items.retain(|i| contains_ignore_ascii_case(i.name().as_bytes(), f));
        }
    }
    let filtered = items.len() as u64;
    let reverse = truthy(&q.sort_reverse);
    let sort = q.sort.as_deref().filter(|s| !s.is_empty());
    let paging = match &q.page {
        None => None,
        Some(p) => {
            let page: u64 = p
                .parse()
                .ok()
                .filter(|&p| p >= 1)
                .ok_or_else(|| ApiError::bad_request(format!("invalid page: {p}")))?;
            let size: u64 = match &q.page_size {
                None => 100,
                Some(s) => s
                    .parse()
                    .ok()
                    .filter(|&s| s >= 1)
                    .ok_or_else(|| ApiError::bad_request(format!("invalid page_size: {s}")))?,
            };
            if size > MAX_PAGE_SIZE {
                return Err(ApiError::bad_request(format!(
                    "page_size {size} is above the maximum of {MAX_PAGE_SIZE}"
                )));
            }
            Some((page, size))
        }
    };
    // Sorted and rendered: either cheaply (sort on names or on counts kept
    // in atomics), rendering only the page, or by rendering everything.
    let rendered: Vec<Value> = match sort {
        Some(field) if items.first().is_some_and(|i| i.cheap_key(field).is_none()) => {
            let mut all: Vec<Value> = items.iter().map(Listable::render).collect();
            all.sort_by(|a, b| cmp_json(lookup(a, field), lookup(b, field)));
            if reverse {
                all.reverse();
            }
            window(all, paging)
        }
        _ => {
            // Only the requested page is sorted in full: the items before
            // it are selected in linear time (select_nth), ties broken by
            // the default order so pages do not overlap.
            match sort {
                Some(field) => {
                    let mut keyed: Vec<(Option<Key>, T)> =
                        items.into_iter().map(|i| (i.cheap_key(field), i)).collect();
                    sort_window(&mut keyed, paging, reverse, |a, b| {
                        a.0.partial_cmp(&b.0)
                            .unwrap_or(Ordering::Equal)
                            .then_with(|| a.1.default_key().cmp(&b.1.default_key()))
                    });
                    items = keyed.into_iter().map(|(_, i)| i).collect();
                }
                None => sort_window(&mut items, paging, reverse, |a, b| {
                    a.default_key().cmp(&b.default_key())
                }),
            }
            window(items, paging).iter().map(Listable::render).collect()
        }
    };
    let rendered: Vec<Value> = match q.columns.as_deref().filter(|c| !c.is_empty()) {
        Some(cols) => {
            let cols: Vec<&str> = cols.split(',').map(str::trim).collect();
            rendered
                .into_iter()
                .map(|v| keep_columns(&v, &cols))
                .collect()
        }
        None => rendered,
    };
    Ok(match paging {
        None => Value::Array(rendered),
        Some((page, size)) => {
            let page_count = filtered.div_ceil(size).max(1);
            if page > page_count && filtered > 0 {
                return Err(ApiError::bad_request(format!(
                    "page {page} is beyond the last page, {page_count}"
                )));
            }
            serde_json::json!({
                "filtered_count": filtered,
                "item_count": rendered.len(),
                "items": rendered,
                "page": page,
                "page_count": page_count,
                "page_size": size,
                "total_count": total,
            })
        }
    })
}

/// Whether `needle` occurs in `hay`, ASCII letters compared without case
/// (no allocation per name).
fn contains_ignore_ascii_case(hay: &[u8], needle: &[u8]) -> bool {
    needle.is_empty()
        || hay
            .windows(needle.len())
            .any(|w| w.eq_ignore_ascii_case(needle))
}

/// Orders `v` so that the page's window holds the right items in order
/// (everything when not paging).
fn sort_window<T>(
    v: &mut [T],
    paging: Option<(u64, u64)>,
    reverse: bool,
    cmp: impl Fn(&T, &T) -> Ordering,
) {
    let cmp = |a: &T, b: &T| if reverse { cmp(b, a) } else { cmp(a, b) };
    let Some((page, size)) = paging else {
        v.sort_by(cmp);
        return;
    };
    let len = v.len();
    let start = (((page - 1) * size) as usize).min(len);
    let end = (start + size as usize).min(len);
    if end < len && end > 0 {
        v.select_nth_unstable_by(end - 1, cmp);
    }
    if start > 0 && start < end {
        v[..end].select_nth_unstable_by(start, cmp);
    }
    v[start..end].sort_by(cmp);
}

fn window<T>(items: Vec<T>, paging: Option<(u64, u64)>) -> Vec<T> {
    match paging {
        None => items,
        Some((page, size)) => {
            let start = ((page - 1) * size) as usize;
            items.into_iter().skip(start).take(size as usize).collect()
        }
    }
}

/// The value at a dotted path.
pub fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

fn cmp_json(a: Option<&Value>, b: Option<&Value>) -> Ordering {
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x
            .as_f64()
            .partial_cmp(&y.as_f64())
            .unwrap_or(Ordering::Equal),
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        _ => Ordering::Equal,
    }
}

fn keep_columns(v: &Value, cols: &[&str]) -> Value {
    let mut out = Value::Object(Map::new());
    for c in cols {
        if let Some(x) = lookup(v, c) {
            let mut at = &mut out;
            let parts: Vec<&str> = c.split('.').collect();
            for (i, p) in parts.iter().enumerate() {
                let Value::Object(m) = at else { break };
                if i + 1 == parts.len() {
                    m.insert(p.to_string(), x.clone());
                    break;
                }
                at = m
                    .entry(p.to_string())
                    .or_insert_with(|| Value::Object(Map::new()));
            }
        }
    }
    out
}
