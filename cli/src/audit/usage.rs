//! The third pass: every read and write of each candidate followed through the function
//! bodies of the crate, and the candidate's use decided from them.
//!
//! A candidate is reached through a field access (`x.seen`, `self.seen`), a static's name, a
//! handler's parameter of a `State<T>`/`Data<T>` type, or a local bound from one of those
//! (`let mut seen = state.seen.lock().await;`, `if let Some(n) = hits.get_mut(&ip)`). Each
//! method called on it, each comparison, increment and assignment of it is an [`Op`], kept with
//! its line, its function and whether it stands in an `if`/`while` condition.

use std::collections::HashMap;

use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Expr, Pat};

use super::kind::{Base, Kind, Place};
use super::model::Spot;

/// How the code reaches a candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// A field of a struct (or an enum variant): `x.name`; through `self` only inside the
    /// owner's `impl`.
    Field {
        /// The struct.
        owner: String,
        /// The field.
        name: String,
    },
    /// A static, by name.
    Static(String),
    /// A type handed to a framework as state: the parameters of that type, by its tokens.
    Root(String),
    /// A local of a spawned task, bound where it is declared.
    Local,
}

/// What the code does with a candidate at one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Op {
    /// `contains`, `contains_key`: a membership test.
    Check,
    /// `get`, `get_mut`: a read of a value.
    Get,
    /// `insert`, `push`, `entry`, an assignment: a write.
    Insert,
    /// `remove`, `retain`, `invalidate`: a removal.
    Remove,
    /// `get_with`, `get_or_insert_with`, `or_insert_with`: computed on a miss.
    Memo,
    /// `fetch_add`, `+= 1`: an increment.
    Count,
    /// `<`, `>`, `<=`, `>=`: a comparison.
    Compare,
    /// `lock`, `write`: a lock taken.
    Lock,
    /// A lock's guard held in a local (`let _guard = LOCK.lock()`).
    Guard,
    /// `check_key`, `until_key_ready`: a limiter asked.
    Limit,
    /// `x % n`: an index taken round a list.
    Modulo,
    /// `mem::take(&mut *guard)`, `drain`: emptied to be handed on.
    Drain,
    /// `subscribe()`: a receiver taken from a broadcast or watch channel.
    Subscribe,
}

impl Op {
    fn of_method(name: &str) -> Option<Op> {
        Some(match name {
            "contains" | "contains_key" | "exists" | "get_key_value" | "peek" => Op::Check,
            "get" | "get_mut" | "try_get" | "get_cloned" | "iter" | "values" | "keys" | "read"
            | "try_read" | "read_owned" | "blocking_read" | "load" => Op::Get,
            "insert" | "put" | "push" | "push_back" | "push_front" | "try_insert" | "extend"
            | "append" | "set" | "store" | "swap" | "replace" | "or_insert" | "or_default"
            | "and_modify" | "entry" | "insert_if_absent" | "upsert" => Op::Insert,
            "remove" | "pop" | "pop_front" | "pop_back" | "clear" | "retain" | "invalidate"
            | "invalidate_all" | "remove_entry" | "take" | "truncate" | "evict" | "remove_if" => {
                Op::Remove
            }
            "drain" | "split_off" => Op::Drain,
            "subscribe" | "new_receiver" => Op::Subscribe,
            "get_with"
            | "try_get_with"
            | "optionally_get_with"
            | "get_or_insert_with"
            | "get_or_try_insert_with"
            | "or_insert_with"
            | "or_try_insert_with"
            | "get_or_init"
            | "get_or_try_init"
            | "get_or_insert"
            | "entry_ref" => Op::Memo,
            "fetch_add" | "fetch_sub" | "fetch_update" | "fetch_max" | "fetch_min"
            | "increment" | "incr" | "inc" | "saturating_add" | "checked_add" => Op::Count,
            "lock" | "write" | "try_lock" | "lock_owned" | "try_write" | "write_owned"
            | "blocking_lock" | "blocking_write" => Op::Lock,
            "check_key" | "until_key_ready" | "check" | "until_ready" | "check_n"
            | "check_key_n" => Op::Limit,
            _ => return None,
        })
    }

    /// How the evidence names the operation.
    pub(crate) fn verb(self) -> &'static str {
        match self {
            Op::Check => "checked",
            Op::Get => "read",
            Op::Insert => "written",
            Op::Remove => "removed from",
            Op::Memo => "computed on a miss",
            Op::Count => "counted",
            Op::Compare => "compared",
            Op::Lock => "locked",
            Op::Guard => "locked, the guard held",
            Op::Limit => "asked as a limiter",
            Op::Modulo => "taken modulo",
            Op::Drain => "drained",
            Op::Subscribe => "subscribed to",
        }
    }
}

/// One use of a candidate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    /// Which candidate.
    pub(crate) cand: usize,
    /// What is done.
    pub(crate) op: Op,
    /// The file.
    pub(crate) file: usize,
    /// The 1-based line.
    pub(crate) line: usize,
    /// The function body it is in (a number unique over the run).
    pub(crate) func: usize,
    /// In an `if`/`while` condition.
    pub(crate) cond: bool,
    /// In a condition whose branch returns early (the work is skipped).
    pub(crate) skip: bool,
    /// A write of a value fetched or computed by a call (`get_…`, `load…`, `fetch…`).
    pub(crate) fetched: bool,
    /// Inside a task the code spawns (`tokio::spawn(async move { .. })`).
    pub(crate) spawned: bool,
}

/// Whether an expression calls something that fetches or computes: a function or method
/// whose name starts with `get_`, `load`, `fetch`, `find`, `query`, `lookup`, `resolve`,
/// `compute`, `build`, `parse`, `render`, `compile`, `retrieve`, `download`, `read_`.
fn fetches(expr: &Expr) -> bool {
    calls_named(expr, &|name: &str| {
        const STARTS: &[&str] = &[
            "get_", "load", "fetch", "find", "query", "lookup", "resolve", "compute", "build",
            "parse", "render", "compile", "retrieve", "download", "read_",
        ];
        STARTS.iter().any(|s| name.starts_with(s))
    })
}

/// Whether an expression calls something that changes data elsewhere: a function or method
/// one of whose words is `exchange`, `redeem`, `consume`, `charge`, `pay`, `create`, `insert`,
/// `delete`, `update`, `execute`, `claim`, `refund`, `transfer`, `submit`, `publish`.
fn changes_data(expr: &Expr) -> bool {
    calls_named(expr, &|name: &str| {
        super::kind::words(name).iter().any(|w| {
            matches!(
                w.as_str(),
                "exchange"
                    | "redeem"
                    | "consume"
                    | "charge"
                    | "pay"
                    | "create"
                    | "insert"
                    | "delete"
                    | "update"
                    | "execute"
                    | "claim"
                    | "refund"
                    | "transfer"
                    | "submit"
                    | "publish"
            )
        })
    })
}

fn calls_named(expr: &Expr, matches: &dyn Fn(&str) -> bool) -> bool {
    struct Calls<'m>(bool, &'m dyn Fn(&str) -> bool);
    impl Calls<'_> {
        fn name(&mut self, name: &str) {
            if (self.1)(name) {
                self.0 = true;
            }
        }
    }
    impl<'ast> Visit<'ast> for Calls<'_> {
        fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
            if let Expr::Path(path) = &*call.func
                && let Some(last) = path.path.segments.last()
            {
                self.name(&last.ident.to_string());
            }
            visit::visit_expr_call(self, call);
        }
        fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
            self.name(&call.method.to_string());
            visit::visit_expr_method_call(self, call);
        }
    }
    let mut calls = Calls(false, matches);
    calls.visit_expr(expr);
    calls.0
}

/// The shape of a candidate's type, as far as its use depends on it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Shape {
    /// A set, or a map to `()`, `bool` or a time: keys only.
    pub(crate) set_like: bool,
    /// A map whose values hold channel senders or sockets.
    pub(crate) senders: bool,
    /// Locks inside a collection (a map of per-key mutexes), or a lock around `()`.
    pub(crate) locks: bool,
    /// A cache type (moka, `LruCache`, …) or a name that says it caches.
    pub(crate) cache: bool,
    /// Values behind their own locks inside a collection: records changed in place.
    pub(crate) mutable_values: bool,
    /// The sending end of a broadcast or watch channel.
    pub(crate) channel: bool,
}

/// A piece of state whose use is to be decided.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    /// Where it is declared.
    pub(crate) spot: Spot,
    /// What it is by its type.
    pub(crate) base: Base,
    /// The shape of its type.
    pub(crate) shape: Shape,
    /// Where it lives.
    pub(crate) place: Place,
    /// How the code reaches it.
    pub(crate) target: Target,
    /// Whether its name, its owner's name, its file or the names beside it speak of work done
    /// (`nonce`, `idempotency`, `consume_nonce`).
    pub(crate) hint_done: bool,
    /// Whether its name or its owner's says it limits a rate (`RatelimitStorage`, `buckets`).
    pub(crate) hint_limit: bool,
    /// The subject of its sentence: "`Mutex<HashSet<..>>` in field `seen` of `AppState`".
    pub(crate) subject: String,
}

/// The use decided for a candidate, with the lines that show it.
#[derive(Debug, Clone)]
pub(crate) struct Decision {
    /// The kind of finding.
    pub(crate) kind: Kind,
    /// What the code does with it, in words: "checked, then inserted".
    pub(crate) how: String,
    /// The events that show the use.
    pub(crate) evidence: Vec<Event>,
}

/// Whether a block or expression leaves early: `return`, `continue`, `break`, `?`-less `Err`.
fn leaves_early(block: &syn::Block) -> bool {
    struct Leaves(bool);
    impl<'ast> Visit<'ast> for Leaves {
        fn visit_expr_return(&mut self, _: &'ast syn::ExprReturn) {
            self.0 = true;
        }
        fn visit_expr_continue(&mut self, _: &'ast syn::ExprContinue) {
            self.0 = true;
        }
        fn visit_expr_closure(&mut self, _: &'ast syn::ExprClosure) {}
    }
    let mut leaves = Leaves(false);
    leaves.visit_block(block);
    if leaves.0 {
        return true;
    }
    // a branch whose value is an error or a refusal: `Err(..)`, `Ok(false)`, `false`
    match block.stmts.last() {
        Some(syn::Stmt::Expr(Expr::Call(call), None)) => {
            matches!(&*call.func, Expr::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Err"))
        }
        _ => false,
    }
}

/// The identifiers a pattern binds.
fn pattern_idents(pat: &Pat, out: &mut Vec<String>) {
    match pat {
        Pat::Ident(ident) => out.push(ident.ident.to_string()),
        Pat::Type(typed) => pattern_idents(&typed.pat, out),
        Pat::Reference(reference) => pattern_idents(&reference.pat, out),
        Pat::TupleStruct(tuple) => {
            for elem in &tuple.elems {
                pattern_idents(elem, out);
            }
        }
        Pat::Tuple(tuple) => {
            for elem in &tuple.elems {
                pattern_idents(elem, out);
            }
        }
        Pat::Paren(paren) => pattern_idents(&paren.pat, out),
        _ => {}
    }
}

/// Where the uses are found: indexes of the candidates by how they are reached.
#[derive(Debug, Default)]
pub(crate) struct Index {
    fields: HashMap<String, Vec<usize>>,
    statics: HashMap<String, Vec<usize>>,
    roots: HashMap<String, Vec<usize>>,
    /// Candidates handed to a function of the crate: (its name, the argument's place) to the
    /// candidates, bound to that parameter where the function is declared.
    pub(crate) flows: HashMap<(String, usize, bool), Vec<usize>>,
}

impl Index {
    /// The index of `candidates`.
    pub(crate) fn new(candidates: &[Candidate]) -> Self {
        let mut index = Index::default();
        for (i, cand) in candidates.iter().enumerate() {
            match &cand.target {
                Target::Field { name, .. } => {
                    index.fields.entry(name.clone()).or_default().push(i);
                }
                Target::Static(name) => index.statics.entry(name.clone()).or_default().push(i),
                Target::Root(key) => index.roots.entry(key.clone()).or_default().push(i),
                Target::Local => {}
            }
        }
        index
    }
}

/// The visitor of one file's function bodies.
pub(crate) struct Uses<'a> {
    file: usize,
    candidates: &'a [Candidate],
    index: &'a Index,
    /// The events found.
    pub(crate) events: Vec<Event>,
    /// The candidates this file hands to functions by argument: (the function's name, the
    /// argument's place, whether it is a method) to the candidates.
    pub(crate) flows: HashMap<(String, usize, bool), Vec<usize>>,
    func: usize,
    next_func: &'a mut usize,
    impl_self: Option<String>,
    aliases: Vec<HashMap<String, Vec<usize>>>,
    cond: u32,
    spawned: u32,
    /// The struct each parameter's written type names, per function.
    param_types: Vec<HashMap<String, String>>,
    /// Task-owned locals to bind where declared: (file, line of the `let`) to candidate.
    locals: &'a HashMap<(usize, usize), usize>,
}

impl<'a> Uses<'a> {
    /// A visitor of file `file`.
    pub(crate) fn new(
        file: usize,
        candidates: &'a [Candidate],
        index: &'a Index,
        next_func: &'a mut usize,
        locals: &'a HashMap<(usize, usize), usize>,
    ) -> Self {
        Uses {
            file,
            candidates,
            index,
            events: Vec::new(),
            flows: HashMap::new(),
            func: 0,
            next_func,
            impl_self: None,
            aliases: vec![HashMap::new()],
            cond: 0,
            spawned: 0,
            param_types: Vec::new(),
            locals,
        }
    }

    /// The struct a parameter's written type names, if it is known.
    fn typed(&self, name: &str) -> Option<String> {
        self.param_types
            .iter()
            .rev()
            .find_map(|scope| scope.get(name))
            .cloned()
    }

    fn alias(&self, name: &str) -> Option<&Vec<usize>> {
        self.aliases.iter().rev().find_map(|scope| scope.get(name))
    }

    fn bind(&mut self, names: Vec<String>, cands: &[usize]) {
        if let Some(scope) = self.aliases.last_mut() {
            for name in names {
                if cands.is_empty() {
                    // a rebinding hides an alias of the same name
                    if scope.contains_key(&name) {
                        scope.insert(name, Vec::new());
                    }
                } else {
                    scope.insert(name, cands.to_vec());
                }
            }
        }
    }

    /// The candidates an expression stands for.
    fn root(&self, expr: &Expr, depth: u8) -> Vec<usize> {
        if depth > 24 {
            return Vec::new();
        }
        match expr {
            // a value computed from the state is not the state
            Expr::MethodCall(call)
                if matches!(
                    call.method.to_string().as_str(),
                    "to_string" | "to_owned" | "len" | "is_empty" | "as_str" | "source"
                ) =>
            {
                Vec::new()
            }
            Expr::MethodCall(call) => self.root(&call.receiver, depth + 1),
            Expr::Field(field) => {
                if let syn::Member::Named(name) = &field.member
                    && let Some(cands) = self.index.fields.get(&name.to_string())
                {
                    let through_self =
                        matches!(&*field.base, Expr::Path(p) if p.path.is_ident("self"));
                    // the owner's type, where the code says it: `self` in an `impl`, a
                    // parameter written with its type (`state: &AppState`)
                    let typed = match &*field.base {
                        Expr::Path(p) if through_self => self.impl_self.clone(),
                        Expr::Path(p) if p.path.segments.len() == 1 => {
                            self.typed(&p.path.segments[0].ident.to_string())
                        }
                        _ => None,
                    };
                    let picked: Vec<usize> = cands
                        .iter()
                        .copied()
                        .filter(|&c| match (&self.candidates[c].target, &typed) {
                            (Target::Field { owner, .. }, Some(current)) => owner == current,
                            _ => true,
                        })
                        .collect();
                    if !picked.is_empty() {
                        return picked;
                    }
                }
                if let syn::Member::Unnamed(index) = &field.member
                    && matches!(&*field.base, Expr::Path(p) if p.path.is_ident("self"))
                    && let Some(current) = &self.impl_self
                    && let Some(cands) = self.index.fields.get(&index.index.to_string())
                {
                    let picked: Vec<usize> = cands
                        .iter()
                        .copied()
                        .filter(|&c| matches!(&self.candidates[c].target, Target::Field { owner, .. } if owner == current))
                        .collect();
                    if !picked.is_empty() {
                        return picked;
                    }
                }
                self.root(&field.base, depth + 1)
            }
            Expr::Path(path) => {
                if path.path.segments.len() == 1 {
                    let name = path.path.segments[0].ident.to_string();
                    if let Some(cands) = self.alias(&name) {
                        return cands.clone();
                    }
                }
                match path.path.segments.last() {
                    Some(last) => self
                        .index
                        .statics
                        .get(&last.ident.to_string())
                        .cloned()
                        .unwrap_or_default(),
                    None => Vec::new(),
                }
            }
            Expr::Unary(unary) => self.root(&unary.expr, depth + 1),
            Expr::Paren(paren) => self.root(&paren.expr, depth + 1),
            Expr::Reference(reference) => self.root(&reference.expr, depth + 1),
            Expr::Try(tried) => self.root(&tried.expr, depth + 1),
            Expr::Await(awaited) => self.root(&awaited.base, depth + 1),
            Expr::Group(group) => self.root(&group.expr, depth + 1),
            Expr::Index(index) => self.root(&index.expr, depth + 1),
            Expr::Cast(cast) => self.root(&cast.expr, depth + 1),
            Expr::Call(call) => match &*call.func {
                Expr::Path(func)
                    if func
                        .path
                        .segments
                        .last()
                        .is_some_and(|s| s.ident == "clone" || s.ident == "Some") =>
                {
                    call.args
                        .first()
                        .map(|arg| self.root(arg, depth + 1))
                        .unwrap_or_default()
                }
                _ => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// Notes the candidates handed as arguments to a function named `callee`: a field, a
    /// static, a local or a reference to one, not a value read from it.
    fn hand_over<'e>(&mut self, callee: &str, method: bool, args: impl Iterator<Item = &'e Expr>) {
        for (at, arg) in args.enumerate() {
            let mut inner = arg;
            while let Expr::Reference(reference) = inner {
                inner = &reference.expr;
            }
            if !matches!(inner, Expr::Field(_) | Expr::Path(_)) {
                continue;
            }
            let cands = self.root(inner, 0);
            if !cands.is_empty() {
                let entry = self
                    .flows
                    .entry((callee.to_owned(), at, method))
                    .or_default();
                for cand in cands {
                    if !entry.contains(&cand) {
                        entry.push(cand);
                    }
                }
            }
        }
    }

    fn record(&mut self, cands: &[usize], op: Op, line: usize) {
        self.record_value(cands, op, line, false);
    }

    fn record_value(&mut self, cands: &[usize], op: Op, line: usize, fetched: bool) {
        for &cand in cands {
            self.events.push(Event {
                cand,
                op,
                file: self.file,
                line,
                func: self.func,
                cond: self.cond > 0,
                skip: false,
                fetched,
                spawned: self.spawned > 0,
            });
        }
    }

    fn in_function<F: FnOnce(&mut Self)>(&mut self, sig: &syn::Signature, f: F) {
        let saved = self.func;
        *self.next_func += 1;
        self.func = *self.next_func;
        self.aliases.push(HashMap::new());
        let mut types = HashMap::new();
        for input in &sig.inputs {
            if let syn::FnArg::Typed(typed) = input
                && let Pat::Ident(ident) = &*typed.pat
                && let Some(name) = owner_type(&typed.ty)
            {
                types.insert(ident.ident.to_string(), name);
            }
        }
        self.param_types.push(types);
        for (names, key) in state_params(sig) {
            if let Some(cands) = self.index.roots.get(&key).cloned() {
                self.bind(names, &cands);
            }
        }
        // the parameters the crate hands a candidate to
        let method = sig.receiver().is_some();
        let name = match (&self.impl_self, method) {
            (Some(owner), false) => format!("{owner}::{}", sig.ident),
            _ => sig.ident.to_string(),
        };
        let typed = sig.inputs.iter().filter_map(|input| match input {
            syn::FnArg::Typed(typed) => Some(typed),
            syn::FnArg::Receiver(_) => None,
        });
        for (at, typed) in typed.enumerate() {
            if let Some(cands) = self.index.flows.get(&(name.clone(), at, method)).cloned() {
                let mut names = Vec::new();
                pattern_idents(&typed.pat, &mut names);
                self.bind(names, &cands);
            }
        }
        f(self);
        self.aliases.pop();
        self.param_types.pop();
        self.func = saved;
    }

    fn condition(&mut self, cond: &Expr, then: Option<&syn::Block>) {
        let before = self.events.len();
        self.cond += 1;
        self.visit_expr(cond);
        self.cond -= 1;
        if then.is_some_and(leaves_early) {
            for event in &mut self.events[before..] {
                event.skip = true;
            }
        }
    }
}

/// The struct a parameter's type names through references and the wrappers state comes in:
/// `&AppState`, `Arc<AppState>`, `web::Data<AppState>`, `State<AppState>`.
fn owner_type(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Reference(reference) => owner_type(&reference.elem),
        syn::Type::Paren(paren) => owner_type(&paren.elem),
        syn::Type::Path(path) => {
            let segment = path.path.segments.last()?;
            let name = segment.ident.to_string();
            if matches!(
                name.as_str(),
                "Arc" | "Rc" | "Box" | "Data" | "State" | "Extension"
            ) && let syn::PathArguments::AngleBracketed(args) = &segment.arguments
            {
                return args.args.iter().find_map(|arg| match arg {
                    syn::GenericArgument::Type(inner) => owner_type(inner),
                    _ => None,
                });
            }
            // a single capital is a generic parameter, not a struct
            (name.len() > 1 && name.starts_with(char::is_uppercase)).then_some(name)
        }
        _ => None,
    }
}

/// The names a parameter binds and the tokens of the state type it takes: `State(s):
/// State<Arc<Mutex<..>>>`, `data: web::Data<Mutex<..>>`, `requests: &State<Arc<..>>`.
fn state_params(sig: &syn::Signature) -> Vec<(Vec<String>, String)> {
    let mut out = Vec::new();
    for input in &sig.inputs {
        let syn::FnArg::Typed(typed) = input else {
            continue;
        };
        let mut names = Vec::new();
        pattern_idents(&typed.pat, &mut names);
        if names.is_empty() {
            continue;
        }
        if let Some(key) = state_key(&typed.ty) {
            out.push((names, key));
        }
    }
    out
}

/// The tokens of `T` in a `State<T>`, `Data<T>` or `Extension<T>` type.
pub(crate) fn state_key(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Reference(reference) => state_key(&reference.elem),
        syn::Type::Path(path) => {
            let segment = path.path.segments.last()?;
            if !matches!(
                segment.ident.to_string().as_str(),
                "State" | "Data" | "Extension"
            ) {
                return None;
            }
            let syn::PathArguments::AngleBracketed(args) = &segment.arguments else {
                return None;
            };
            args.args.iter().find_map(|arg| match arg {
                syn::GenericArgument::Type(ty) => {
                    Some(quote::ToTokens::to_token_stream(ty).to_string())
                }
                _ => None,
            })
        }
        _ => None,
    }
}

impl<'ast> Visit<'ast> for Uses<'_> {
    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        let saved = self.impl_self.take();
        if let syn::Type::Path(path) = &*item.self_ty {
            self.impl_self = path.path.segments.last().map(|s| s.ident.to_string());
        }
        visit::visit_item_impl(self, item);
        self.impl_self = saved;
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.in_function(&item.sig, |this| visit::visit_item_fn(this, item));
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        self.in_function(&item.sig, |this| visit::visit_impl_item_fn(this, item));
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        self.in_function(&item.sig, |this| visit::visit_trait_item_fn(this, item));
    }

    fn visit_local(&mut self, local: &'ast syn::Local) {
        if let Some(init) = &local.init {
            self.visit_expr(&init.expr);
            if let Some((_, diverge)) = &init.diverge {
                self.visit_expr(diverge);
            }
        }
        let mut names = Vec::new();
        pattern_idents(&local.pat, &mut names);
        let line = local.let_token.span.start().line;
        if let Some(&cand) = self.locals.get(&(self.file, line)) {
            self.bind(names, &[cand]);
            return;
        }
        let cands = local
            .init
            .as_ref()
            .map(|init| self.root(&init.expr, 0))
            .unwrap_or_default();
        // a guard held in a local: `let _guard = LOCK.lock().await;`
        if let Some(init) = &local.init
            && !cands.is_empty()
            && let Some(method) = last_method(&init.expr)
            && Op::of_method(&method) == Some(Op::Lock)
        {
            self.record(&cands, Op::Guard, line);
        }
        self.bind(names, &cands);
    }

    fn visit_expr_let(&mut self, expr: &'ast syn::ExprLet) {
        self.visit_expr(&expr.expr);
        let cands = self.root(&expr.expr, 0);
        let mut names = Vec::new();
        pattern_idents(&expr.pat, &mut names);
        self.bind(names, &cands);
    }

    fn visit_expr_if(&mut self, expr: &'ast syn::ExprIf) {
        self.condition(&expr.cond, Some(&expr.then_branch));
        self.visit_block(&expr.then_branch);
        if let Some((_, other)) = &expr.else_branch {
            self.visit_expr(other);
        }
    }

    fn visit_expr_while(&mut self, expr: &'ast syn::ExprWhile) {
        self.condition(&expr.cond, None);
        self.visit_block(&expr.body);
    }

    fn visit_expr_match(&mut self, expr: &'ast syn::ExprMatch) {
        let before = self.events.len();
        self.cond += 1;
        self.visit_expr(&expr.expr);
        self.cond -= 1;
        let early = expr.arms.iter().any(|arm| match &*arm.body {
            Expr::Return(_) | Expr::Continue(_) => true,
            Expr::Block(block) => leaves_early(&block.block),
            _ => false,
        });
        if early {
            for event in &mut self.events[before..] {
                event.skip = true;
            }
        }
        let cands = self.root(&expr.expr, 0);
        for arm in &expr.arms {
            let mut names = Vec::new();
            pattern_idents(&arm.pat, &mut names);
            self.bind(names, &cands);
            self.visit_arm(arm);
        }
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        let method = call.method.to_string();
        // the crate's own methods; not the collections' and iterators' own, whose names the
        // crate's types often share
        if Op::of_method(&method).is_none()
            && !matches!(
                method.as_str(),
                "chain"
                    | "zip"
                    | "map"
                    | "and_then"
                    | "or_else"
                    | "filter"
                    | "send"
                    | "push_str"
                    | "eq"
                    | "cmp"
                    | "partial_cmp"
                    | "fmt"
                    | "hash"
                    | "into"
                    | "from"
                    | "clone_from"
                    | "extend_from_slice"
            )
        {
            self.hand_over(&method, true, call.args.iter());
        }
        let cands = self.root(&call.receiver, 0);
        if let Some(op) = Op::of_method(&method)
            && !cands.is_empty()
        {
            let fetched = match op {
                Op::Insert => call.args.last().is_some_and(fetches),
                // a value computed on a miss by work that changes data: a once-guard
                Op::Memo => !call.args.iter().any(changes_data),
                _ => false,
            };
            self.record_value(&cands, op, call.method.span().start().line, fetched);
        }
        if cands.is_empty() {
            visit::visit_expr_method_call(self, call);
            return;
        }
        // a closure handed the state's entry binds it: `.and_modify(|v| v.count += 1)`
        self.visit_expr(&call.receiver);
        for arg in &call.args {
            if let Expr::Closure(closure) = arg {
                self.aliases.push(HashMap::new());
                for input in &closure.inputs {
                    let mut names = Vec::new();
                    pattern_idents(input, &mut names);
                    self.bind(names, &cands);
                }
                self.visit_expr(&closure.body);
                self.aliases.pop();
            } else {
                self.visit_expr(arg);
            }
        }
    }

    fn visit_expr_binary(&mut self, expr: &'ast syn::ExprBinary) {
        use syn::BinOp;
        let line = expr.op.span().start().line;
        match expr.op {
            BinOp::Lt(_) | BinOp::Le(_) | BinOp::Gt(_) | BinOp::Ge(_) => {
                let mut cands = self.root(&expr.left, 0);
                cands.extend(self.root(&expr.right, 0));
                self.record(&cands, Op::Compare, line);
            }
            BinOp::AddAssign(_) | BinOp::SubAssign(_) => {
                let cands = self.root(&expr.left, 0);
                self.record(&cands, Op::Count, line);
            }
            BinOp::Rem(_) => {
                let cands = self.root(&expr.left, 0);
                self.record(&cands, Op::Modulo, line);
            }
            _ => {}
        }
        visit::visit_expr_binary(self, expr);
    }

    fn visit_expr_assign(&mut self, expr: &'ast syn::ExprAssign) {
        let cands = self.root(&expr.left, 0);
        let fetched = fetches(&expr.right);
        self.record_value(&cands, Op::Insert, expr.eq_token.span.start().line, fetched);
        visit::visit_expr_assign(self, expr);
    }

    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        // `mem::take(&mut *counts)`, `mem::replace(..)`: emptied to be handed on
        if let Expr::Path(func) = &*call.func
            && func.path.segments.len() >= 2
            && func
                .path
                .segments
                .last()
                .is_some_and(|s| s.ident == "take" || s.ident == "replace" || s.ident == "swap")
            && let Some(first) = call.args.first()
        {
            let cands = self.root(first, 0);
            self.record(&cands, Op::Drain, first.span().start().line);
        }
        // `f(..)` is the crate's free function `f`; `T::f(..)` the function `f` of `impl T`
        if let Expr::Path(func) = &*call.func {
            let segments: Vec<String> = func
                .path
                .segments
                .iter()
                .map(|s| s.ident.to_string())
                .collect();
            let callee = match segments.as_slice() {
                [name] => Some(name.clone()),
                [.., owner, name] if owner != "Self" => Some(format!("{owner}::{name}")),
                [.., _, name] => self.impl_self.as_ref().map(|t| format!("{t}::{name}")),
                [] => None,
            };
            if let Some(callee) = callee {
                self.hand_over(&callee, false, call.args.iter());
            }
        }
        let spawns = matches!(&*call.func, Expr::Path(p) if p.path.segments.last().is_some_and(|s| {
            matches!(s.ident.to_string().as_str(), "spawn" | "spawn_local" | "spawn_blocking")
        }));
        if spawns {
            self.spawned += 1;
        }
        visit::visit_expr_call(self, call);
        if spawns {
            self.spawned -= 1;
        }
    }

    fn visit_expr_closure(&mut self, closure: &'ast syn::ExprClosure) {
        self.aliases.push(HashMap::new());
        visit::visit_expr_closure(self, closure);
        self.aliases.pop();
    }
}

/// The last method of a call chain, through `.await`, `?` and `unwrap`.
fn last_method(expr: &Expr) -> Option<String> {
    match expr {
        Expr::MethodCall(call) => {
            let name = call.method.to_string();
            if matches!(name.as_str(), "unwrap" | "expect" | "unwrap_or_else") {
                last_method(&call.receiver)
            } else {
                Some(name)
            }
        }
        Expr::Await(awaited) => last_method(&awaited.base),
        Expr::Try(tried) => last_method(&tried.expr),
        _ => None,
    }
}

/// The use of a candidate, from its events (sorted by file and line).
pub(crate) fn decide(cand: &Candidate, events: &[Event]) -> Decision {
    let in_func = |func: usize, ops: &[Op]| {
        events
            .iter()
            .filter(|e| e.func == func && ops.contains(&e.op))
            .copied()
            .collect::<Vec<_>>()
    };
    let first = |ops: &[Op]| events.iter().find(|e| ops.contains(&e.op)).copied();
    let decision = |kind: Kind, how: &str, mut evidence: Vec<Event>| {
        evidence.sort_by_key(|e| (e.file, e.line));
        evidence.dedup_by_key(|e| (e.file, e.line));
        Decision {
            kind,
            how: how.to_owned(),
            evidence,
        }
    };
    let done = cand.shape.set_like || cand.hint_done;

    // a broadcast channel connections subscribe to: its messages stay on this copy
    if cand.shape.channel {
        if let Some(subscribe) = first(&[Op::Subscribe]) {
            return decision(
                Kind::InProcessSubscribers,
                "subscribed to by connections and sent to",
                vec![subscribe],
            );
        }
        return decision(
            Kind::InProcessState,
            "a channel no connection subscribes to",
            events.iter().take(1).copied().collect(),
        );
    }
    if cand.base == Base::Semaphore {
        return decision(
            Kind::InProcessConcurrencyLimit,
            "permits taken",
            events.iter().take(1).copied().collect(),
        );
    }
    // asked as a limiter
    if let Some(event) = first(&[Op::Limit])
        && !cand.shape.cache
    {
        return decision(Kind::InProcessRateLimit, "asked as a limiter", vec![event]);
    }
    // inserted in a condition: `if !seen.insert(id) { return }`
    if let Some(event) = events.iter().find(|e| e.op == Op::Insert && e.cond)
        && done
    {
        return decision(
            Kind::AlreadyDone,
            "inserted, and the work done only if it was not there",
            vec![*event],
        );
    }
    // counted and compared in one function
    for count in events.iter().filter(|e| e.op == Op::Count) {
        if let Some(compare) = in_func(count.func, &[Op::Compare]).first() {
            if count.spawned {
                // the tasks this copy spawns itself, bounded by this copy's own maximum
                return decision(
                    Kind::InProcessState,
                    "counts the tasks this copy spawns: its own capacity",
                    vec![*count, *compare],
                );
            }
            return decision(
                Kind::InProcessRateLimit,
                "counted and compared with a limit",
                vec![*count, *compare],
            );
        }
    }
    // a round-robin index: `NEXT.fetch_add(1) % servers.len()`
    if let Some(modulo) = first(&[Op::Modulo])
        && cand.base == Base::Counter
    {
        return decision(
            Kind::InProcessState,
            "an index taken round a list",
            vec![modulo],
        );
    }
    // counted, then drained to be written elsewhere: each copy hands on its own increments
    if let Some(drain) = first(&[Op::Drain])
        && let Some(count) = first(&[Op::Count])
        && first(&[Op::Compare]).is_none()
    {
        return decision(
            Kind::InProcessState,
            "counted, then drained and handed on as increments",
            vec![count, drain],
        );
    }
    // checked, then inserted, in one function (a cache checked and filled is a memo)
    for check in events
        .iter()
        .filter(|e| e.op == Op::Check || (e.op == Op::Get && e.cond && done && !cand.shape.cache))
    {
        if let Some(insert) = in_func(check.func, &[Op::Insert]).first()
            && (done || (check.op == Op::Check && !cand.shape.cache))
        {
            return decision(
                Kind::AlreadyDone,
                "checked, then inserted around the work",
                vec![*check, *insert],
            );
        }
    }
    // a once-guard in cache's clothing: computed on a miss by work that changes data
    if let Some(memo) = events.iter().find(|e| e.op == Op::Memo && !e.fetched) {
        return decision(
            Kind::AlreadyDone,
            "computed once by work that changes data, the result replayed to repeats",
            vec![*memo],
        );
    }
    // a once-guard in cache's clothing: read to skip the work, written when it is done
    if cand.hint_done
        && let Some(skip) = events
            .iter()
            .find(|e| e.skip && matches!(e.op, Op::Check | Op::Get))
        && let Some(insert) = first(&[Op::Insert])
    {
        return decision(
            Kind::AlreadyDone,
            "read to skip the work, and written when it is done",
            vec![*skip, insert],
        );
    }
    // a one-time token: read and removed in one function
    if cand.hint_done {
        for get in events
            .iter()
            .filter(|e| matches!(e.op, Op::Get | Op::Check))
        {
            if let Some(remove) = in_func(get.func, &[Op::Remove]).first() {
                return decision(
                    Kind::AlreadyDone,
                    "read, then removed: used once",
                    vec![*get, *remove],
                );
            }
        }
    }
    // a lock held around other work
    if cand.shape.locks
        && let Some(guard) = first(&[Op::Guard]).or_else(|| first(&[Op::Lock]))
    {
        return decision(Kind::InProcessLock, "locked around the work", vec![guard]);
    }
    if cand.base == Base::Lock
        && let Some(guard) = first(&[Op::Guard])
        && events.iter().all(|e| matches!(e.op, Op::Lock | Op::Guard))
    {
        return decision(Kind::InProcessLock, "locked around the work", vec![guard]);
    }
    // memoised: computed on a miss, filled with what was fetched, or read (returning early
    // when present) and filled in one function
    let inserts: Vec<&Event> = events.iter().filter(|e| e.op == Op::Insert).collect();
    let memo = first(&[Op::Memo])
        .or_else(|| (!inserts.is_empty() && inserts.iter().all(|e| e.fetched)).then(|| *inserts[0]))
        .or_else(|| {
            events
                .iter()
                .filter(|e| e.skip && matches!(e.op, Op::Get | Op::Check | Op::Compare))
                .find(|read| !in_func(read.func, &[Op::Insert]).is_empty())
                .copied()
        });
    // a cache invalidated where the data changes: the other copies keep the old entry
    if cand.shape.cache
        && let Some(remove) = events.iter().find(|e| {
            e.op == Op::Remove
                && !events
                    .iter()
                    .any(|o| o.func == e.func && matches!(o.op, Op::Get | Op::Insert | Op::Memo))
        })
        && let Some(fill) = first(&[Op::Insert, Op::Memo])
    {
        return decision(
            Kind::InProcessRecord,
            "cached, and invalidated when the data changes",
            vec![fill, *remove],
        );
    }
    let counted = first(&[Op::Count]);
    if !cand.shape.senders
        && !cand.shape.mutable_values
        && !cand.hint_done
        && (memo.is_some() || (cand.shape.cache && counted.is_none()))
    {
        let evidence: Vec<Event> = memo.into_iter().chain(first(&[Op::Insert])).collect();
        return decision(
            Kind::InProcessCache,
            "memoises fetched or computed data",
            evidence,
        );
    }
    if cand.base == Base::Counter && !events.is_empty() {
        // a value only stored (a timestamp, a gauge) is this copy's own reading
        if let Some(count) = counted {
            return decision(Kind::InProcessCounter, "counted", vec![count]);
        }
        return decision(
            Kind::InProcessState,
            "stored, never counted",
            events.iter().take(1).copied().collect(),
        );
    }
    if let Some(write) = first(&[Op::Insert, Op::Remove, Op::Count, Op::Memo]) {
        let read = events
            .iter()
            .find(|e| e.func != write.func && matches!(e.op, Op::Get | Op::Check | Op::Lock))
            .copied();
        let evidence: Vec<Event> = std::iter::once(write).chain(read).collect();
        if cand.shape.senders {
            return decision(
                Kind::InProcessSubscribers,
                "connections registered and sent to",
                evidence,
            );
        }
        if cand.hint_done && cand.shape.set_like {
            return decision(Kind::AlreadyDone, "a record of work done", evidence);
        }
        if cand.hint_limit {
            return decision(
                Kind::InProcessRateLimit,
                "written and read as rate-limit buckets",
                evidence,
            );
        }
        return decision(
            Kind::InProcessRecord,
            "written by requests and read by others",
            evidence,
        );
    }
    if events.is_empty() {
        // no use seen: judged by its type and name
        if cand.hint_done && matches!(cand.base, Base::Map | Base::Cache) {
            return decision(
                Kind::AlreadyDone,
                "named for work done (no use seen)",
                Vec::new(),
            );
        }
        return decision(Kind::InProcessState, "no use seen", Vec::new());
    }
    decision(
        Kind::InProcessState,
        "read, no write seen",
        events.iter().take(1).copied().collect(),
    )
}
