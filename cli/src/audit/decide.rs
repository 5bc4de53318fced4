//! The second pass: which structs are application state, and the findings.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use super::Finding;
use super::kind::{Base, Kind, Place, names_cache, names_done_work, names_rate_limit, words};
use super::model::{
    Model, Spot, Types, is_collection, is_lock, is_resource, is_sender_name, show, type_names,
    unwrap_shared, walk_paths,
};
use super::scan::{Collected, KnownType};
use super::usage::{Candidate, Event, Index, Shape, Target, Uses, decide};

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

/// One piece of evidence: a line that shows the use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Evidence {
    /// The file, relative to the audited path.
    pub(crate) file: String,
    /// The 1-based line.
    pub(crate) line: usize,
    /// What the line does with the state: "checked", "written", "compared".
    pub(crate) what: &'static str,
}

/// The shape of a candidate's type and name.
fn shape_of(types: &Types<'_>, model: &Model, ty: &syn::Type, name: &str) -> Shape {
    // the type with the aliases it names spelled out (one level): `LockPeer` = `Arc<RwLock<Peer>>`
    let mut names = Vec::new();
    let mut tokens = quote::ToTokens::to_token_stream(ty).to_string();
    for name in type_names(ty) {
        let alias = model.aliases.get(&name).and_then(|a| a.first());
        names.push(name);
        if let Some(alias) = alias {
            names.extend(type_names(&alias.ty));
            tokens.push(' ');
            tokens.push_str(&quote::ToTokens::to_token_stream(&alias.ty).to_string());
        }
    }
    let first_collection = names.iter().position(|n| is_collection(n));
    let set_like = first_collection.is_some_and(|at| names[at].ends_with("Set"))
        || (first_collection.is_some()
            && [
                ", () >",
                ", bool >",
                ", Instant >",
                ", SystemTime >",
                "DateTime",
            ]
            .iter()
            .any(|end| tokens.contains(end)));
    let sender = |n: &str| is_sender_name(n);
    let mut senders = first_collection.is_some() && names.iter().any(|n| sender(n));
    if first_collection.is_some() && !senders {
        // a map of a struct or an alias of the code read that holds a sender: `Vec<UserSenders>`
        senders = names.iter().any(|n| {
            model.structs.get(n).is_some_and(|defs| {
                defs.iter().any(|def| {
                    def.fields
                        .iter()
                        .any(|f| type_names(&f.ty).iter().any(|t| sender(t)))
                })
            }) || model.aliases.get(n).is_some_and(|aliases| {
                aliases
                    .iter()
                    .any(|a| type_names(&a.ty).iter().any(|t| sender(t)))
            })
        });
    }
    // a lock around nothing, alone or per key: a lock used as a lock
    let locks = tokens.contains("Mutex < () >")
        || tokens.contains("RwLock < () >")
        || first_collection.is_some_and(|at| names[at + 1..].iter().any(|n| n == "Semaphore"));
    // locks around values inside a collection: records changed in place
    let mutable_values =
        !locks && first_collection.is_some_and(|at| names[at + 1..].iter().any(|n| is_lock(n)));
    Shape {
        channel: false,
        mutable_values,
        set_like,
        senders,
        locks,
        cache: types.is_cache_type(ty) || names_cache(name),
    }
}

/// Whether the file a candidate is in speaks of work done: its path, or the names of the
/// items beside it (`IdempotencyKey`, `consume_nonce`).
fn file_speaks_of_done(model: &Model, file: usize) -> bool {
    let source = &model.files[file];
    let speaks = |text: &str| {
        let text = text.to_lowercase();
        text.contains("idempot") || text.contains("nonce") || text.contains("dedup")
    };
    speaks(&source.rel) || source.item_names.iter().any(|n| speaks(n))
}

/// What the audit is told beside the code: `--all`, and the user's known types.
#[derive(Debug, Default)]
pub(crate) struct Options {
    /// List memoising caches and state whose use is not seen too.
    pub(crate) all: bool,
}

/// The findings from the model and the first pass, sorted by file, line and kind.
pub(crate) fn findings(
    model: &Model,
    collected: Collected,
    files: &[(usize, syn::File)],
    known: &[KnownType],
    options: &Options,
) -> Vec<Finding> {
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut direct: Vec<(Spot, Kind, String, Place)> = Vec::new();
    let roots: HashSet<String> = collected.root_names.iter().cloned().collect();
    let elsewhere: HashSet<&String> = collected.built_elsewhere.iter().collect();
    let per_connection: HashSet<&String> = collected
        .per_connection
        .iter()
        .filter(|name| !roots.contains(*name) && !elsewhere.contains(name))
        .collect();

    let mut places = state_structs(model, &collected);
    // an actor's fields change through `&mut self` in its handlers, wherever its `Addr` is held
    for actor in &collected.actors {
        if model.structs.contains_key(actor) {
            places.insert(actor.clone(), Place::Actor);
        }
    }
    // a struct that holds a channel's receiving end and collections: a task's own state
    for (name, defs) in &model.structs {
        let receives = defs.iter().any(|def| {
            def.fields.iter().any(|f| {
                type_names(&f.ty)
                    .iter()
                    .any(|t| t.ends_with("Receiver") || t == "Inbox")
            })
        });
        if receives {
            places.entry(name.clone()).or_insert(Place::Task);
        }
    }
    // state built per connection is not shared by the requests of a copy
    places.retain(|name, _| !per_connection.contains(name));

    let known_kind = |types: &Types<'_>, ty: &syn::Type| -> Option<(Option<Kind>, String)> {
        let mut found = None;
        walk_paths(ty, &mut |path| {
            let Some(last) = path.segments.last() else {
                return;
            };
            let name = last.ident.to_string();
            for k in known {
                if k.name == name
                    && k.krate.as_deref().is_none_or(|krate| {
                        types.is_from(path, krate) || path.segments.iter().any(|s| s.ident == krate)
                    })
                {
                    found = Some((k.kind, name.clone()));
                }
            }
        });
        found
    };

    for (name, place) in &places {
        if is_resource(name) {
            continue;
        }
        for def in model.structs.get(name).into_iter().flatten() {
            let types = Types::new(model, def.file);
            for field in &def.fields {
                if let Some((kind, type_name)) = known_kind(&types, &field.ty) {
                    match kind {
                        Some(kind) => {
                            let message = format!(
                                "`{}` in field `{}` of `{}`: `{type_name}` keeps its state in \
                                 process memory",
                                show(&field.ty),
                                field.name,
                                def.name
                            );
                            direct.push((field.spot, kind, message, Place::Library));
                            continue;
                        }
                        None => {
                            candidates.push(Candidate {
                                spot: field.spot,
                                base: Base::Map,
                                shape: shape_of(&types, model, &field.ty, &field.name),
                                place: *place,
                                target: Target::Field {
                                    owner: def.name.clone(),
                                    name: field.name.clone(),
                                },
                                hint_done: names_done_work(&field.name)
                                    || names_done_work(&def.name),
                                hint_limit: names_rate_limit(&field.name)
                                    || names_rate_limit(&def.name),
                                subject: format!(
                                    "`{}` in field `{}` of `{}`",
                                    types.describe(&field.ty),
                                    field.name,
                                    def.name
                                ),
                            });
                            continue;
                        }
                    }
                }
                let base = match place {
                    Place::Actor => types.owned(&field.ty),
                    // a task's own collections: its counters and flags are its own business
                    Place::Task => types
                        .owned(&field.ty)
                        .filter(|b| matches!(b, Base::Map | Base::Cache)),
                    _ => types.shared(&field.ty),
                };
                // a broadcast or watch channel's sender: judged by whether connections subscribe
                let channel = base.is_none() && types.is_broadcast(&field.ty);
                let Some(base) = base.or(channel.then_some(Base::Map)) else {
                    continue;
                };
                // configuration reloaded in each copy
                if words(&field.name)
                    .iter()
                    .any(|w| matches!(w.as_str(), "config" | "configs" | "settings" | "options"))
                {
                    continue;
                }
                let mut shape = shape_of(&types, model, &field.ty, &field.name);
                shape.channel = channel;
                let hint_done = names_done_work(&field.name)
                    || names_done_work(&def.name)
                    || (shape.set_like && file_speaks_of_done(model, def.file));
                candidates.push(Candidate {
                    spot: field.spot,
                    base,
                    shape,
                    place: *place,
                    target: Target::Field {
                        owner: def.name.clone(),
                        name: field.name.clone(),
                    },
                    hint_done,
                    hint_limit: names_rate_limit(&field.name) || names_rate_limit(&def.name),
                    subject: format!(
                        "`{}` in field `{}` of `{}`",
                        types.describe(&field.ty),
                        field.name,
                        def.name
                    ),
                });
            }
        }
    }

    // a type handed to the framework directly: one candidate per type, where first written
    let mut root_keys: HashSet<String> = HashSet::new();
    for root in &collected.root_types {
        let types = Types::new(model, root.spot.file);
        let inner = unwrap_shared(&root.ty);
        if types.is_struct(inner) {
            continue;
        }
        let key = quote::ToTokens::to_token_stream(&root.ty).to_string();
        if !root_keys.insert(key.clone()) {
            continue;
        }
        let (spot, ty, label, file) = match types.alias(inner) {
            Some((name, alias)) => (alias.spot, &alias.ty, name.to_owned(), alias.spot.file),
            None => (root.spot, &root.ty, String::new(), root.spot.file),
        };
        let Some(base) = Types::new(model, file).shared(ty) else {
            continue;
        };
        let shape = shape_of(&types, model, ty, &label);
        let subject = if label.is_empty() {
            format!(
                "`{}` shared with every request as `{}<..>`",
                show(ty),
                root.wrapper
            )
        } else {
            format!(
                "`{}` in type `{label}`, shared with every request as `{}<{label}>`",
                show(ty),
                root.wrapper
            )
        };
        candidates.push(Candidate {
            spot,
            base,
            shape,
            place: Place::State,
            target: Target::Root(key),
            hint_done: names_done_work(&label)
                || (shape.set_like && file_speaks_of_done(model, file)),
            hint_limit: names_rate_limit(&label),
            subject,
        });
    }

    for item in &collected.statics {
        let types = Types::new(model, item.spot.file);
        if let Some((Some(kind), type_name)) = known_kind(&types, &item.ty) {
            let message = format!(
                "`{}` in `static {}`: `{type_name}` keeps its state in process memory",
                show(&item.ty),
                item.name
            );
            direct.push((item.spot, kind, message, Place::Library));
            continue;
        }
        // one per thread: scoped to the requests a thread runs, as a task's state is
        if item.thread_local && !options.all {
            continue;
        }
        let base = if item.mutable {
            types.guarded(&item.ty)
        } else {
            types.shared(&item.ty)
        };
        let Some(base) = base else {
            continue;
        };
        let shape = shape_of(&types, model, &item.ty, &item.name);
        let subject = if item.thread_local {
            format!(
                "a per-thread `{}` in `thread_local!` `{}`",
                show(&item.ty),
                item.name
            )
        } else {
            let keyword = if item.mutable { "static mut" } else { "static" };
            format!(
                "a process-wide `{}` in `{keyword} {}`",
                types.describe(&item.ty),
                item.name
            )
        };
        candidates.push(Candidate {
            spot: item.spot,
            base,
            shape,
            place: Place::Static,
            target: Target::Static(item.name.clone()),
            hint_done: names_done_work(&item.name)
                || (shape.set_like && file_speaks_of_done(model, item.spot.file)),
            hint_limit: names_rate_limit(&item.name),
            subject,
        });
    }

    let mut locals: HashMap<(usize, usize), usize> = HashMap::new();
    for local in &collected.task_locals {
        locals.insert((local.spot.file, local.spot.line), candidates.len());
        candidates.push(Candidate {
            spot: local.spot,
            base: local.base,
            shape: Shape {
                set_like: local.set_like,
                ..Shape::default()
            },
            place: Place::Task,
            target: Target::Local,
            hint_done: names_done_work(&local.name)
                || (local.set_like && file_speaks_of_done(model, local.spot.file)),
            hint_limit: names_rate_limit(&local.name),
            subject: format!("`{}` (`{}`)", local.name, local.built),
        });
    }

    // every use of every candidate, through the function bodies of all files; again while
    // candidates are handed to functions of the crate not yet followed (at most three times)
    let mut index = Index::new(&candidates);
    let mut events: Vec<Event> = Vec::new();
    for _ in 0..3 {
        events.clear();
        let mut next_func = 0;
        let mut flows: HashMap<(String, usize, bool), Vec<usize>> = HashMap::new();
        for (file, syntax) in files {
            let mut uses = Uses::new(*file, &candidates, &index, &mut next_func, &locals);
            syn::visit::Visit::visit_file(&mut uses, syntax);
            events.extend(uses.events);
            for (key, cands) in uses.flows {
                let entry = flows.entry(key).or_default();
                for cand in cands {
                    if !entry.contains(&cand) {
                        entry.push(cand);
                    }
                }
            }
        }
        if flows == index.flows {
            break;
        }
        index.flows = flows;
    }
    let mut by_candidate: Vec<Vec<Event>> = vec![Vec::new(); candidates.len()];
    for event in events {
        by_candidate[event.cand].push(event);
    }

    let mut found: Vec<(Spot, Kind, String, Place, String, Vec<Evidence>)> = Vec::new();
    for (cand, mut events) in candidates.iter().zip(by_candidate) {
        events.sort_by_key(|e| (e.file, e.line));
        let decision = decide(cand, &events);
        // a channel no connection subscribes to is a queue of this copy's own: not state
        if cand.shape.channel && decision.kind == Kind::InProcessState {
            continue;
        }
        if decision.kind.only_with_all() && !options.all {
            continue;
        }
        let evidence: Vec<Evidence> = decision
            .evidence
            .iter()
            .map(|e| Evidence {
                file: model.files[e.file].rel.clone(),
                line: e.line,
                what: e.op.verb(),
            })
            .collect();
        let how = if cand.place == Place::Task && decision.kind == Kind::InProcessRecord {
            "filled from the messages the task receives".to_owned()
        } else {
            decision.how
        };
        let message = format!("{}, {}: {how}", cand.subject, cand.place.held());
        found.push((cand.spot, decision.kind, message, cand.place, how, evidence));
    }
    for hit in collected.hits {
        direct.push((hit.spot, hit.kind, hit.message, Place::Library));
    }
    for (spot, kind, message, place) in direct {
        found.push((
            spot,
            kind,
            message,
            place,
            "keeps its state in process memory".to_owned(),
            Vec::new(),
        ));
    }

    let mut seen: HashSet<(usize, usize, Kind)> = HashSet::new();
    let mut findings: Vec<Finding> = found
        .into_iter()
        .filter(|(spot, ..)| !allowed(&model.files[spot.file].lines, *spot))
        .filter(|(spot, kind, ..)| seen.insert((spot.file, spot.line, *kind)))
        .map(|(spot, kind, message, place, how, evidence)| Finding {
            file: model.files[spot.file].rel.clone(),
            line: spot.line,
            kind,
            place,
            used_as: how,
            message,
            evidence,
            breaks: kind.breaks().to_owned(),
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
