//! The second pass: which structs are application state, and the findings.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::Finding;
use super::kind::{Kind, Place};
use super::model::{Model, Spot, Types, is_resource, show, unwrap_shared};
use super::scan::Collected;

/// Whether a struct's name says it is an application's state or context.
fn named_as_state(name: &str) -> bool {
    name.ends_with("State") || name.ends_with("Ctx") || name.ends_with("Context")
}

/// The structs that are application state, with the place that holds them: handed to a
/// framework (or named so, or cloned into handlers with shared locks), or held in a static,
/// and every struct their fields contain.
fn state_structs(model: &Model, collected: &Collected) -> BTreeMap<String, Place> {
    let mut places: BTreeMap<String, Place> = BTreeMap::new();
    let mark = |places: &mut BTreeMap<String, Place>, name: &str, place: Place| {
        if model.structs.contains_key(name) {
            places.entry(name.to_owned()).or_insert(place);
        }
    };
    for name in &collected.root_names {
        mark(&mut places, name, Place::State);
    }
    for root in &collected.root_types {
        let mut refs = Vec::new();
        Types::new(model, root.spot.file).struct_refs(&root.ty, &mut refs);
        for name in refs {
            mark(&mut places, &name, Place::State);
        }
    }
    for (name, defs) in &model.structs {
        let cloned_with_shared_state = defs.iter().any(|def| {
            def.derives_clone
                && def.fields.iter().any(|field| {
                    let types = Types::new(model, def.file);
                    types.is_arc(&field.ty) && types.shared(&field.ty).is_some()
                })
        });
        if named_as_state(name) || cloned_with_shared_state {
            mark(&mut places, name, Place::State);
        }
    }
    for item in &collected.statics {
        let mut refs = Vec::new();
        Types::new(model, item.spot.file).struct_refs(&item.ty, &mut refs);
        for name in refs {
            mark(&mut places, &name, Place::Static);
        }
    }
    // every struct a state struct's fields contain is state too, held in the same place
    let mut queue: Vec<(String, Place)> = places.iter().map(|(n, p)| (n.clone(), *p)).collect();
    while let Some((name, place)) = queue.pop() {
        for def in model.structs.get(&name).into_iter().flatten() {
            for field in &def.fields {
                let mut refs = Vec::new();
                Types::new(model, def.file).struct_refs(&field.ty, &mut refs);
                for inner in refs {
                    if !places.contains_key(&inner) {
                        places.insert(inner.clone(), place);
                        queue.push((inner, place));
                    }
                }
            }
        }
    }
    places
}

/// The first line of an allow comment's reason, if `text` holds
/// `// tollgate: allow(<reason>)` with a reason.
fn allows(text: &str) -> bool {
    let Some(comment) = text.find("//") else {
        return false;
    };
    let comment = &text[comment..];
    let Some(at) = comment.find("tollgate:") else {
        return false;
    };
    let rest = comment[at + "tollgate:".len()..].trim_start();
    let Some(rest) = rest.strip_prefix("allow(") else {
        return false;
    };
    rest.find(')')
        .is_some_and(|end| !rest[..end].trim().is_empty())
}

/// Whether an allow comment silences a finding: at the end of its line, or among the comment
/// and attribute lines directly above the line or above the start of its item.
fn allowed(lines: &[String], spot: Spot) -> bool {
    let text = |n: usize| lines.get(n.wrapping_sub(1)).map_or("", String::as_str);
    if allows(text(spot.line)) {
        return true;
    }
    let above = |mut n: usize| {
        while n > 1 {
            n -= 1;
            let trimmed = text(n).trim_start();
            if !(trimmed.starts_with("//") || trimmed.starts_with("#[")) {
                return false;
            }
            if allows(trimmed) {
                return true;
            }
        }
        false
    };
    above(spot.line) || above(spot.start)
}

/// The findings from the model and the first pass, sorted by file, line and kind.
pub(crate) fn findings(model: &Model, collected: Collected) -> Vec<Finding> {
    let mut found: Vec<(Spot, Kind, String)> = Vec::new();

    for (name, place) in state_structs(model, &collected) {
        // the parts of a pool or a client (`DbPool { pool, semaphore }`) are that copy's own
        if is_resource(&name) {
            continue;
        }
        for def in model.structs.get(&name).into_iter().flatten() {
            let types = Types::new(model, def.file);
            for field in &def.fields {
                let Some(base) = types.shared(&field.ty) else {
                    continue;
                };
                let base = base.named(&field.name);
                let kind = base.kind(place, &format!("{}_{}", def.name, field.name));
                let held = match place {
                    Place::State => "the application's shared state",
                    Place::Static => "held in a static",
                };
                let message = format!(
                    "`{}` in field `{}` of `{}`, {held}: {}",
                    types.describe(&field.ty),
                    field.name,
                    def.name,
                    base.why(kind)
                );
                found.push((field.spot, kind, message));
            }
        }
    }

    // a type handed to the framework directly: reported once, where it is first written
    let mut by_type: BTreeMap<String, Vec<(Spot, Kind, String)>> = BTreeMap::new();
    let mut aliases_seen: HashSet<String> = HashSet::new();
    for root in &collected.root_types {
        let types = Types::new(model, root.spot.file);
        let inner = unwrap_shared(&root.ty);
        if types.is_struct(inner) {
            continue;
        }
        if let Some((name, alias)) = types.alias(inner) {
            if !aliases_seen.insert(name.to_owned()) {
                continue;
            }
            let alias_types = Types::new(model, alias.spot.file);
            if let Some(base) = alias_types.shared(&alias.ty) {
                let base = base.named(name);
                let kind = base.kind(Place::State, name);
                let message = format!(
                    "`{}` in type `{name}`, shared with every request as `{}<{name}>`: {}",
                    show(&alias.ty),
                    root.wrapper,
                    base.why(kind)
                );
                found.push((alias.spot, kind, message));
            }
            continue;
        }
        let Some(base) = types.shared(&root.ty) else {
            continue;
        };
        let kind = base.kind(Place::State, "");
        let shown = show(&root.ty);
        let message = format!(
            "`{shown}` shared with every request as `{}<..>`: {}",
            root.wrapper,
            base.why(kind)
        );
        let key = quote::ToTokens::to_token_stream(&root.ty).to_string();
        by_type
            .entry(key)
            .or_default()
            .push((root.spot, kind, message));
    }
    for (_, mut uses) in by_type {
        let silenced = uses
            .iter()
            .any(|(spot, _, _)| allowed(&model.files[spot.file].lines, *spot));
        if !silenced && !uses.is_empty() {
            found.push(uses.remove(0));
        }
    }

    for item in &collected.statics {
        let types = Types::new(model, item.spot.file);
        let base = if item.mutable {
            types.guarded(&item.ty)
        } else {
            types.shared(&item.ty)
        };
        let Some(base) = base else {
            continue;
        };
        let base = base.named(&item.name);
        let kind = base.kind(Place::Static, &item.name);
        let message = if item.thread_local {
            format!(
                "a per-thread `{}` in `thread_local!` `{}`: every thread of every copy has its \
                 own, so what one request records is not seen by requests on other threads or \
                 copies",
                show(&item.ty),
                item.name,
            )
        } else {
            let keyword = if item.mutable { "static mut" } else { "static" };
            format!(
                "a process-wide `{}` in `{keyword} {}`: {}",
                types.describe(&item.ty),
                item.name,
                base.why(kind)
            )
        };
        found.push((item.spot, kind, message));
    }

    for hit in collected.hits {
        found.push((hit.spot, hit.kind, hit.message));
    }

    let mut seen: HashMap<(usize, usize, Kind), ()> = HashMap::new();
    let mut findings: Vec<Finding> = found
        .into_iter()
        .filter(|(spot, _, _)| !allowed(&model.files[spot.file].lines, *spot))
        .filter(|(spot, kind, _)| seen.insert((spot.file, spot.line, *kind), ()).is_none())
        .map(|(spot, kind, message)| Finding {
            file: model.files[spot.file].rel.clone(),
            line: spot.line,
            kind,
            message,
            fix: kind.fix().to_owned(),
        })
        .collect();
    findings.sort_by(|a, b| (&a.file, a.line, a.kind).cmp(&(&b.file, b.line, b.kind)));
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_comments() {
        assert!(allows("// tollgate: allow(one copy only)"));
        assert!(allows("    x: u8, // tollgate:allow(read at start)"));
        assert!(!allows("// tollgate: allow()"));
        assert!(!allows("// tollgate: allow(  )"));
        assert!(!allows("// tollgate: deny(x)"));
        assert!(!allows("let s = \"tollgate: allow(x)\";"));
        assert!(!allows("// allow(x)"));
    }

    #[test]
    fn allow_above_item_and_line() {
        let lines: Vec<String> = [
            "// tollgate: allow(one copy)",
            "#[derive(Debug)]",
            "/// docs",
            "static A: u8 = 0;",
            "",
            "static B: u8 = 0;",
            "fn f() {}",
            "static C: u8 = 0; // tollgate: allow(tests)",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let spot = |line, start| Spot {
            file: 0,
            line,
            start,
        };
        assert!(allowed(&lines, spot(4, 2)));
        assert!(!allowed(&lines, spot(6, 6)));
        assert!(allowed(&lines, spot(8, 8)));
        assert!(!allowed(&lines, spot(7, 7)));
    }
}
