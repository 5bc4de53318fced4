//! The first pass: one file's syntax tree read for structs, aliases, statics, the types and
//! values handed to a framework as application state, and in-process limiters.

use std::collections::HashMap;

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Attribute, Expr, GenericArgument, Ident, Pat, PathArguments, Token, Type};

use super::kind::Kind;
use super::model::{Alias, Field, Model, Spot, Static, StructDef, Uses};

/// A finding decided in the first pass, from one expression.
#[derive(Debug)]
pub(crate) struct Hit {
    /// What it is.
    pub(crate) kind: Kind,
    /// The finding's sentence.
    pub(crate) message: String,
    /// Where.
    pub(crate) spot: Spot,
}

/// A type handed to a framework as application state: `State<T>`, `Extension<T>`,
/// `Data<T>`.
#[derive(Debug)]
pub(crate) struct RootType {
    /// `T`.
    pub(crate) ty: Type,
    /// The wrapper's name.
    pub(crate) wrapper: String,
    /// Where `T` is written; the start is the enclosing item's.
    pub(crate) spot: Spot,
}

/// What the first pass found in all files, beside the [`Model`].
#[derive(Debug, Default)]
pub(crate) struct Collected {
    /// Types handed to a framework as state.
    pub(crate) root_types: Vec<RootType>,
    /// Names of the types of values handed to a framework as state (`.with_state(..)`,
    /// `.app_data(..)`, `XServer::new(..)`, a tonic service `impl`).
    pub(crate) root_names: Vec<String>,
    /// The statics.
    pub(crate) statics: Vec<Static>,
    /// The limiters found in expressions.
    pub(crate) hits: Vec<Hit>,
    /// The structs with an actix `impl Actor`: their fields are reached through an `Addr`.
    pub(crate) actors: Vec<String>,
    /// The structs built once per connection or per request (`ws::start(X { .. })`, in an
    /// `on_upgrade` closure, in a function given a socket or a request): not state across
    /// requests.
    pub(crate) per_connection: Vec<String>,
    /// The structs built in functions that take no request nor connection (start-up code):
    /// state built there may be shared even when it is also built per request.
    pub(crate) built_elsewhere: Vec<String>,
    /// The collections a task owns and fills from a channel.
    pub(crate) task_locals: Vec<TaskLocal>,
}

/// A local collection or counter of a task fed by a channel: `let mut seen = HashSet::new();
/// while let Some(m) = rx.recv().await { .. }`.
#[derive(Debug)]
pub(crate) struct TaskLocal {
    /// Its name.
    pub(crate) name: String,
    /// What it is.
    pub(crate) base: super::kind::Base,
    /// A set.
    pub(crate) set_like: bool,
    /// What built it, for the sentence: `HashMap::new()`.
    pub(crate) built: String,
    /// Where it is declared (the line of its `let`).
    pub(crate) spot: Spot,
}

/// A library type known to keep state in process memory, with the kind it is reported as.
#[derive(Debug, Clone)]
pub(crate) struct KnownType {
    /// The crate it must come from, if any (`tower_sessions`).
    pub(crate) krate: Option<String>,
    /// The type's name (`MemoryStore`).
    pub(crate) name: String,
    /// The kind reported; `None` for a type judged by its use as a map.
    pub(crate) kind: Option<Kind>,
}

/// The library types known to keep state in process memory and reported wherever they are
/// built (the first element is the crate or a module path it must come from), beside the limiters recognised by their constructors (tower's, governor's) and the
/// maps, sets and caches judged by their use (`model.rs`).
pub(crate) const KNOWN_TYPES: &[(&str, &str, Kind)] = &[
    ("tower_sessions", "MemoryStore", Kind::InProcessStore),
    (
        "tower_sessions_memory_store",
        "MemoryStore",
        Kind::InProcessStore,
    ),
    ("async_session", "MemoryStore", Kind::InProcessStore),
    ("axum_sessions", "MemoryStore", Kind::InProcessStore),
    ("async_sqlx_session", "MemoryStore", Kind::InProcessStore),
    (
        "actix_extensible_rate_limit",
        "InMemoryBackend",
        Kind::InProcessRateLimit,
    ),
    ("actix_ratelimit", "MemoryStore", Kind::InProcessRateLimit),
    (
        "actix_ratelimit",
        "MemoryStoreActor",
        Kind::InProcessRateLimit,
    ),
    ("actix_limitation", "Limiter", Kind::InProcessRateLimit),
    ("leaky_bucket", "RateLimiter", Kind::InProcessRateLimit),
    ("ratelimit", "Ratelimiter", Kind::InProcessRateLimit),
    (
        "rocket_governor",
        "RocketGovernor",
        Kind::InProcessRateLimit,
    ),
    ("tollgate", "MemoryStore", Kind::InProcessStore),
    // mCaptcha's embedded actors: visitor counts per site that set the difficulty, and the
    // proof-of-work configurations and verification tokens that may be used once
    (
        "libmcaptcha::master::embedded",
        "Master",
        Kind::InProcessRateLimit,
    ),
    (
        "libmcaptcha::cache::hashcache",
        "HashCache",
        Kind::AlreadyDone,
    ),
];

/// The crates of in-process rate limiters built on `governor`.
const GOVERNOR_CRATES: &[&str] = &[
    "governor",
    "tower_governor",
    "actix_governor",
    "axum_governor",
];

fn line(span: Span) -> usize {
    span.start().line
}

/// Whether the attributes make an item test-only: `#[cfg(test)]` (not under `not`), `#[test]`,
/// `#[tokio::test]` and the like.
pub(crate) fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|attr| {
        let path = attr.path();
        if path.is_ident("cfg") {
            let mut idents = Vec::new();
            if let syn::Meta::List(list) = &attr.meta {
                collect_idents(list.tokens.clone(), &mut idents);
            }
            idents.iter().any(|i| i == "test") && !idents.iter().any(|i| i == "not")
        } else {
            path.segments.last().is_some_and(|s| s.ident == "test")
        }
    })
}

fn collect_idents(tokens: TokenStream, out: &mut Vec<String>) {
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => out.push(ident.to_string()),
            TokenTree::Group(group) => collect_idents(group.stream(), out),
            _ => {}
        }
    }
}

fn derives_clone(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|attr| {
        if !attr.path().is_ident("derive") {
            return false;
        }
        let mut idents = Vec::new();
        if let syn::Meta::List(list) = &attr.meta {
            collect_idents(list.tokens.clone(), &mut idents);
        }
        idents.iter().any(|i| i == "Clone")
    })
}

/// Reads the `use` declarations of a file, at every depth.
pub(crate) fn uses_of(file: &syn::File) -> Uses {
    struct UseVisitor(Uses);
    impl<'ast> Visit<'ast> for UseVisitor {
        fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
            self.0.add(&item.tree);
        }
        fn visit_item_macro(&mut self, item: &'ast syn::ItemMacro) {
            for inner in items_in_macro(item) {
                self.visit_item(&inner);
            }
        }
    }
    let mut visitor = UseVisitor(Uses::default());
    visitor.visit_file(file);
    visitor.0
}

/// The items of an item-position macro that wraps items in braces, as `cfg_if!` and
/// `cfg_select!` do: each top-level `{ .. }` group that parses as items. Not `macro_rules!`
/// definitions, `lazy_static!` nor `thread_local!`.
fn items_in_macro(item: &syn::ItemMacro) -> Vec<syn::Item> {
    let name = item.mac.path.segments.last().map(|s| s.ident.to_string());
    if item.ident.is_some()
        || matches!(
            name.as_deref(),
            Some("macro_rules" | "lazy_static" | "thread_local")
        )
    {
        return Vec::new();
    }
    let mut items = Vec::new();
    for token in item.mac.tokens.clone() {
        if let TokenTree::Group(group) = token
            && group.delimiter() == proc_macro2::Delimiter::Brace
            && let Ok(file) = syn::parse2::<syn::File>(group.stream())
        {
            items.extend(file.items);
        }
    }
    items
}

/// One entry of `lazy_static!` or `thread_local!`.
struct MacroStatic {
    attrs: Vec<Attribute>,
    static_token: Token![static],
    ident: Ident,
    ty: Type,
    expr: Expr,
}

/// The body of `lazy_static!` (`static ref NAME: T = e;`) or `thread_local!`
/// (`static NAME: T = e;`, `= const { e }`).
struct MacroStatics(Vec<MacroStatic>);

impl Parse for MacroStatics {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut entries = Vec::new();
        while !input.is_empty() {
            let attrs = input.call(Attribute::parse_outer)?;
            let _: syn::Visibility = input.parse()?;
            let static_token: Token![static] = input.parse()?;
            if input.peek(Token![ref]) {
                let _: Token![ref] = input.parse()?;
            }
            let ident: Ident = input.parse()?;
            let _: Token![:] = input.parse()?;
            let ty: Type = input.parse()?;
            let _: Token![=] = input.parse()?;
            let expr: Expr = input.parse()?;
            if !input.is_empty() {
                let _: Token![;] = input.parse()?;
            }
            entries.push(MacroStatic {
                attrs,
                static_token,
                ident,
                ty,
                expr,
            });
        }
        Ok(MacroStatics(entries))
    }
}

/// A local binding: its initializer or its written type.
#[derive(Debug, Clone)]
enum Binding {
    Init(Expr),
    Typed(Type),
}

/// The `let` bindings of a function body, by name.
fn bindings_of(block: &syn::Block) -> HashMap<String, Vec<Binding>> {
    struct Lets(HashMap<String, Vec<Binding>>);
    impl<'ast> Visit<'ast> for Lets {
        fn visit_local(&mut self, local: &'ast syn::Local) {
            let (pat, ty) = match &local.pat {
                Pat::Type(typed) => (&*typed.pat, Some(&*typed.ty)),
                other => (other, None),
            };
            if let Pat::Ident(ident) = pat {
                let entry = self.0.entry(ident.ident.to_string()).or_default();
                if let Some(ty) = ty {
                    entry.push(Binding::Typed(ty.clone()));
                } else if let Some(init) = &local.init {
                    entry.push(Binding::Init((*init.expr).clone()));
                }
            }
            visit::visit_local(self, local);
        }
    }
    let mut lets = Lets(HashMap::new());
    lets.visit_block(block);
    lets.0
}

/// The name of the type a value has, as far as it shows in the expression: a struct literal,
/// `T::new(..)`, `Arc::new(T { .. })`, a variable bound to one of those.
fn type_name_of_type(ty: &Type) -> Option<String> {
    let ty = super::model::unwrap_shared(ty);
    let Type::Path(path) = ty else {
        return None;
    };
    let segment = path.path.segments.last()?;
    let name = segment.ident.to_string();
    if matches!(name.as_str(), "Data" | "State" | "Extension")
        && let PathArguments::AngleBracketed(args) = &segment.arguments
        && let Some(GenericArgument::Type(inner)) = args.args.first()
    {
        return type_name_of_type(inner);
    }
    Some(name)
}

/// The collector of one file.
struct Collector<'a> {
    file: usize,
    uses: &'a Uses,
    model: &'a mut Model,
    out: &'a mut Collected,
    lets: Vec<HashMap<String, Vec<Binding>>>,
    item_starts: Vec<usize>,
    known: &'a [KnownType],
    /// The type of the `impl` being read.
    impl_self: Option<String>,
}

/// The names of the types built in a block: struct literals and `T::new(..)`-like calls.
fn constructed(block: &syn::Block) -> Vec<String> {
    struct Built(Vec<String>);
    impl<'ast> Visit<'ast> for Built {
        fn visit_expr_struct(&mut self, expr: &'ast syn::ExprStruct) {
            if let Some(last) = expr.path.segments.last() {
                self.0.push(last.ident.to_string());
            }
            visit::visit_expr_struct(self, expr);
        }
        fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
            if let Expr::Path(func) = &*call.func {
                let n = func.path.segments.len();
                if n >= 2 {
                    let owner = func.path.segments[n - 2].ident.to_string();
                    if owner.starts_with(char::is_uppercase) {
                        self.0.push(owner);
                    }
                } else if let Some(only) = func.path.segments.first() {
                    // a tuple struct: `RequestLog(..)`
                    let name = only.ident.to_string();
                    if name.starts_with(char::is_uppercase)
                        && !matches!(name.as_str(), "Some" | "Ok" | "Err")
                    {
                        self.0.push(name);
                    }
                }
            }
            visit::visit_expr_call(self, call);
        }
    }
    let mut built = Built(Vec::new());
    built.visit_block(block);
    built.0
}

/// Whether a function takes a request (`Request`, `HttpRequest`, `ServiceRequest`, `Parts`):
/// what it builds is built per request.
fn takes_request(sig: &syn::Signature) -> bool {
    sig.inputs.iter().any(|input| {
        let syn::FnArg::Typed(typed) = input else {
            return false;
        };
        super::model::type_names(&typed.ty).iter().any(|name| {
            matches!(
                name.as_str(),
                "Request" | "HttpRequest" | "ServiceRequest" | "Parts" | "RequestParts"
            )
        })
    })
}

/// Whether a function takes a connection: a websocket, a TCP or Unix stream, an actix-ws
/// session.
fn takes_connection(sig: &syn::Signature) -> bool {
    sig.inputs.iter().any(|input| {
        let syn::FnArg::Typed(typed) = input else {
            return false;
        };
        super::model::type_names(&typed.ty).iter().any(|name| {
            matches!(
                name.as_str(),
                "WebSocket"
                    | "WebSocketStream"
                    | "WsStream"
                    | "TcpStream"
                    | "UnixStream"
                    | "Framed"
                    | "MessageStream"
                    | "Upgraded"
            ) || (name == "Session" && typed.ty.to_token_stream_string().contains("actix_ws"))
        })
    })
}

trait TokensString {
    fn to_token_stream_string(&self) -> String;
}

impl<T: quote::ToTokens> TokensString for T {
    fn to_token_stream_string(&self) -> String {
        quote::ToTokens::to_token_stream(self).to_string()
    }
}

/// Whether a block receives from a channel in a loop: `while let Some(m) = rx.recv().await`,
/// `loop { select! { m = rx.recv() => .. } }`, `for m in rx`.
fn receives_in_loop(block: &syn::Block) -> bool {
    struct Recv {
        depth: u32,
        found: bool,
    }
    impl<'ast> Visit<'ast> for Recv {
        fn visit_expr_while(&mut self, expr: &'ast syn::ExprWhile) {
            self.depth += 1;
            visit::visit_expr_while(self, expr);
            self.depth -= 1;
        }
        fn visit_expr_loop(&mut self, expr: &'ast syn::ExprLoop) {
            self.depth += 1;
            visit::visit_expr_loop(self, expr);
            self.depth -= 1;
        }
        fn visit_expr_for_loop(&mut self, expr: &'ast syn::ExprForLoop) {
            if let Expr::Path(path) = &*expr.expr
                && path.path.segments.last().is_some_and(|s| {
                    let name = s.ident.to_string();
                    name == "rx" || name.ends_with("_rx") || name.contains("receiver")
                })
            {
                self.found = true;
            }
            self.depth += 1;
            visit::visit_expr_for_loop(self, expr);
            self.depth -= 1;
        }
        fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
            if self.depth > 0
                && matches!(
                    call.method.to_string().as_str(),
                    "recv" | "recv_async" | "recv_many" | "blocking_recv"
                )
            {
                self.found = true;
            }
            visit::visit_expr_method_call(self, call);
        }
        fn visit_macro(&mut self, mac: &'ast syn::Macro) {
            // `select!` arms are tokens: a `recv` among them, inside a loop, counts
            if self.depth > 0 && mac.tokens.to_string().contains(". recv (") {
                self.found = true;
            }
        }
    }
    let mut recv = Recv {
        depth: 0,
        found: false,
    };
    recv.visit_block(block);
    recv.found
}

impl Collector<'_> {
    /// The collections and counters a block that receives in a loop declares as its own.
    fn task_locals(&mut self, block: &syn::Block) {
        if !receives_in_loop(block) {
            return;
        }
        for stmt in &block.stmts {
            let syn::Stmt::Local(local) = stmt else {
                continue;
            };
            let (pat, ty) = match &local.pat {
                Pat::Type(typed) => (&*typed.pat, Some(&*typed.ty)),
                other => (other, None),
            };
            let Pat::Ident(ident) = pat else {
                continue;
            };
            if ident.mutability.is_none() {
                continue;
            }
            let Some(init) = &local.init else {
                continue;
            };
            let built = quote::ToTokens::to_token_stream(&*init.expr)
                .to_string()
                .replace(' ', "");
            let mut names: Vec<String> = ty.map(super::model::type_names).unwrap_or_default();
            if let Expr::Call(call) = &*init.expr
                && let Expr::Path(func) = &*call.func
            {
                names.extend(func.path.segments.iter().map(|s| s.ident.to_string()));
            }
            let collection = names.iter().find(|n| super::model::is_collection(n));
            // a task's counters and flags are its own business: only its collections
            let Some(name) = collection else {
                continue;
            };
            let base = if name.ends_with("Cache") {
                super::kind::Base::Cache
            } else {
                super::kind::Base::Map
            };
            let set_like = collection.is_some_and(|n| n.ends_with("Set"));
            let let_line = line(local.let_token.span);
            self.out.task_locals.push(TaskLocal {
                name: ident.ident.to_string(),
                base,
                set_like,
                built,
                spot: Spot {
                    file: self.file,
                    line: let_line,
                    start: let_line,
                },
            });
        }
    }

    fn spot(&self, span: Span) -> Spot {
        Spot {
            file: self.file,
            line: line(span),
            start: line(span),
        }
    }

    fn type_name(&self, expr: &Expr, depth: u8) -> Option<String> {
        if depth > 8 {
            return None;
        }
        match expr {
            Expr::Struct(literal) => literal.path.segments.last().map(|s| s.ident.to_string()),
            Expr::Call(call) => {
                let Expr::Path(func) = &*call.func else {
                    return None;
                };
                let segments: Vec<String> = func
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let n = segments.len();
                let owner = if n >= 2 {
                    &segments[n - 2]
                } else {
                    &segments[0]
                };
                if matches!(
                    owner.as_str(),
                    "Arc" | "Rc" | "Box" | "Data" | "Extension" | "State"
                ) {
                    return call.args.first().and_then(|a| self.type_name(a, depth + 1));
                }
                owner
                    .starts_with(char::is_uppercase)
                    .then(|| owner.clone())
                    .filter(|o| o != "Some" && o != "Ok")
            }
            Expr::MethodCall(call) => self.type_name(&call.receiver, depth + 1),
            Expr::Reference(reference) => self.type_name(&reference.expr, depth + 1),
            Expr::Paren(paren) => self.type_name(&paren.expr, depth + 1),
            Expr::Await(awaited) => self.type_name(&awaited.base, depth + 1),
            Expr::Try(tried) => self.type_name(&tried.expr, depth + 1),
            Expr::Group(group) => self.type_name(&group.expr, depth + 1),
            Expr::Path(path) if path.path.segments.len() == 1 => {
                let name = path.path.segments[0].ident.to_string();
                let bindings = self.lets.iter().rev().find_map(|lets| lets.get(&name))?;
                bindings.iter().find_map(|binding| match binding {
                    Binding::Typed(ty) => type_name_of_type(ty),
                    Binding::Init(init) => self.type_name(init, depth + 1),
                })
            }
            _ => None,
        }
    }

    fn root_value(&mut self, expr: &Expr) {
        if let Some(name) = self.type_name(expr, 0) {
            self.out.root_names.push(name);
        }
    }

    fn hit(&mut self, kind: Kind, what: &str, span: Span) {
        let noun = match kind {
            Kind::InProcessConcurrencyLimit => "an in-process concurrency limit",
            Kind::InProcessStore => "an in-process store",
            Kind::AlreadyDone => "an in-process record of what was done",
            Kind::InProcessLock => "an in-process lock",
            Kind::InProcessRecord => "in-process records",
            Kind::InProcessCounter => "an in-process counter",
            Kind::InProcessSubscribers => "in-process subscribers",
            _ => "an in-process rate limiter",
        };
        let message = format!("{noun} ({what})");
        let spot = self.spot(span);
        self.out.hits.push(Hit {
            kind,
            message,
            spot,
        });
    }

    fn add_static(
        &mut self,
        name: &Ident,
        ty: &Type,
        mutable: bool,
        thread_local: bool,
        start: usize,
    ) {
        let spot = Spot {
            file: self.file,
            line: line(name.span()),
            start,
        };
        self.out.statics.push(Static {
            name: name.to_string(),
            ty: ty.clone(),
            mutable,
            thread_local,
            spot,
        });
    }

    fn macro_statics(&mut self, mac: &syn::Macro) {
        let Some(last) = mac.path.segments.last() else {
            return;
        };
        let thread_local = last.ident == "thread_local";
        if !(thread_local || last.ident == "lazy_static") {
            return;
        }
        let Ok(entries) = mac.parse_body::<MacroStatics>() else {
            return;
        };
        for entry in entries.0 {
            if is_test_only(&entry.attrs) {
                continue;
            }
            let start = entry
                .attrs
                .first()
                .map_or(line(entry.static_token.span), |a| line(a.pound_token.span));
            self.add_static(&entry.ident, &entry.ty, false, thread_local, start);
            self.visit_expr(&entry.expr);
        }
    }

    /// A function's body: the types it builds are per connection when it takes a connection;
    /// its own collections are a task's when it receives from a channel in a loop.
    fn fn_body(&mut self, sig: &syn::Signature, block: &syn::Block) {
        if takes_connection(sig) || takes_request(sig) {
            // built, and collections kept, once per connection or request
            self.out.per_connection.extend(constructed(block));
            return;
        }
        // a type's own constructor (`impl State { fn from(..) -> State { State { .. } } }`) says
        // nothing of where it is built
        let own = self.impl_self.clone();
        self.out.built_elsewhere.extend(
            constructed(block)
                .into_iter()
                .filter(|name| Some(name) != own.as_ref() && name != "Self"),
        );
        self.task_locals(block);
    }

    /// The known library types built by a call `T::f(..)`.
    fn known_call(&mut self, path: &syn::Path) {
        let n = path.segments.len();
        if n < 2 {
            return;
        }
        // through renamed imports: `use lib::master::Master as EmbeddedMaster;`
        let resolved = self.uses.resolve(path);
        let parts: Vec<&str> = resolved.split("::").collect();
        let owner = parts
            .len()
            .checked_sub(2)
            .and_then(|at| parts.get(at))
            .map_or_else(
                || path.segments[n - 2].ident.to_string(),
                |s| (*s).to_owned(),
            );
        let module = parts[..parts.len().saturating_sub(2)].join("::");
        let known: Vec<KnownType> = self
            .known
            .iter()
            .filter(|k| {
                k.name == owner
                    && k.kind.is_some()
                    && k.krate.as_deref().is_none_or(|krate| {
                        module == krate
                            || module.starts_with(&format!("{krate}::"))
                            || (!krate.contains("::")
                                && (self.uses.is_from(path, &[krate])
                                    || path.segments.iter().any(|s| s.ident == krate)))
                    })
            })
            .cloned()
            .collect();
        for k in known {
            let Some(kind) = k.kind else { continue };
            let what = match &k.krate {
                Some(krate) => format!("{krate}'s `{}`", k.name),
                None => format!("`{}`", k.name),
            };
            self.hit(kind, &what, path.span());
        }
    }

    fn with_item<F: FnOnce(&mut Self)>(&mut self, start: usize, f: F) {
        self.item_starts.push(start);
        f(self);
        self.item_starts.pop();
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_test_only(&item.attrs) {
            visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if is_test_only(&item.attrs) {
            return;
        }
        self.fn_body(&item.sig, &item.block);
        self.lets.push(bindings_of(&item.block));
        self.with_item(line(item.span()), |this| visit::visit_item_fn(this, item));
        self.lets.pop();
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if is_test_only(&item.attrs) {
            return;
        }
        self.fn_body(&item.sig, &item.block);
        self.lets.push(bindings_of(&item.block));
        self.with_item(line(item.span()), |this| {
            visit::visit_impl_item_fn(this, item);
        });
        self.lets.pop();
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        if is_test_only(&item.attrs) {
            return;
        }
        if let Some((_, trait_path, _)) = &item.trait_
            && trait_path
                .segments
                .last()
                .is_some_and(|s| s.ident == "Actor")
            && (self.uses.is_from(trait_path, &["actix"])
                || trait_path.segments.iter().any(|s| s.ident == "actix"))
            && let Some(name) = type_name_of_type(&item.self_ty)
        {
            self.out.actors.push(name);
        }
        if let Some((_, trait_path, _)) = &item.trait_ {
            let tonic_attr = item.attrs.iter().any(|attr| {
                let segments: Vec<String> = attr
                    .path()
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                segments == ["tonic", "async_trait"]
            });
            let generated_service = self.uses.resolve(trait_path).contains("_server::");
            if (tonic_attr || generated_service)
                && let Some(name) = type_name_of_type(&item.self_ty)
            {
                self.out.root_names.push(name);
            }
        }
        let saved = self.impl_self.take();
        self.impl_self = type_name_of_type(&item.self_ty);
        visit::visit_item_impl(self, item);
        self.impl_self = saved;
    }

    fn visit_item_struct(&mut self, item: &'ast syn::ItemStruct) {
        if is_test_only(&item.attrs) {
            return;
        }
        let fields = item
            .fields
            .iter()
            .enumerate()
            .map(|(index, field)| {
                let (name, at) = match &field.ident {
                    Some(ident) => (ident.to_string(), line(ident.span())),
                    None => (index.to_string(), line(field.ty.span())),
                };
                Field {
                    name,
                    ty: field.ty.clone(),
                    spot: Spot {
                        file: self.file,
                        line: at,
                        start: line(field.span()),
                    },
                }
            })
            .collect();
        let name = item.ident.to_string();
        self.model
            .structs
            .entry(name.clone())
            .or_default()
            .push(StructDef {
                name,
                fields,
                derives_clone: derives_clone(&item.attrs),
                file: self.file,
            });
        self.with_item(line(item.span()), |this| {
            visit::visit_item_struct(this, item);
        });
    }

    fn visit_item_type(&mut self, item: &'ast syn::ItemType) {
        if is_test_only(&item.attrs) {
            return;
        }
        let spot = Spot {
            file: self.file,
            line: line(item.ident.span()),
            start: line(item.span()),
        };
        self.model
            .aliases
            .entry(item.ident.to_string())
            .or_default()
            .push(Alias {
                ty: (*item.ty).clone(),
                spot,
            });
        self.with_item(spot.start, |this| visit::visit_item_type(this, item));
    }

    fn visit_item_static(&mut self, item: &'ast syn::ItemStatic) {
        if is_test_only(&item.attrs) {
            return;
        }
        let mutable = matches!(item.mutability, syn::StaticMutability::Mut(_));
        self.add_static(&item.ident, &item.ty, mutable, false, line(item.span()));
        self.with_item(line(item.span()), |this| {
            visit::visit_item_static(this, item);
        });
    }

    fn visit_item_macro(&mut self, item: &'ast syn::ItemMacro) {
        if !is_test_only(&item.attrs) {
            self.macro_statics(&item.mac);
            for inner in items_in_macro(item) {
                self.visit_item(&inner);
            }
        }
    }

    fn visit_item_enum(&mut self, item: &'ast syn::ItemEnum) {
        if is_test_only(&item.attrs) {
            return;
        }
        // an enum's variants hold state as a struct's fields do: `Cache::Memory(MemoryCache)`
        let mut fields = Vec::new();
        for variant in &item.variants {
            for (index, field) in variant.fields.iter().enumerate() {
                let (name, at) = match &field.ident {
                    Some(ident) => (format!("{}.{ident}", variant.ident), line(ident.span())),
                    None => (format!("{}.{index}", variant.ident), line(field.ty.span())),
                };
                fields.push(Field {
                    name,
                    ty: field.ty.clone(),
                    spot: Spot {
                        file: self.file,
                        line: at,
                        start: line(field.span()),
                    },
                });
            }
        }
        let name = item.ident.to_string();
        self.model
            .structs
            .entry(name.clone())
            .or_default()
            .push(StructDef {
                name,
                fields,
                derives_clone: derives_clone(&item.attrs),
                file: self.file,
            });
        self.with_item(line(item.span()), |this| visit::visit_item_enum(this, item));
    }

    fn visit_stmt_macro(&mut self, stmt: &'ast syn::StmtMacro) {
        if !is_test_only(&stmt.attrs) {
            self.macro_statics(&stmt.mac);
        }
    }

    fn visit_type_path(&mut self, path: &'ast syn::TypePath) {
        if let Some(segment) = path.path.segments.last() {
            let wrapper = segment.ident.to_string();
            if matches!(wrapper.as_str(), "State" | "Extension" | "Data")
                && let PathArguments::AngleBracketed(args) = &segment.arguments
            {
                let first = args.args.iter().find_map(|arg| match arg {
                    GenericArgument::Type(ty) => Some(ty),
                    _ => None,
                });
                if let Some(ty) = first {
                    let mut spot = self.spot(ty.span());
                    spot.start = self.item_starts.last().copied().unwrap_or(spot.line);
                    self.out.root_types.push(RootType {
                        ty: ty.clone(),
                        wrapper,
                        spot,
                    });
                }
            }
        }
        visit::visit_type_path(self, path);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        let method = call.method.to_string();
        match (method.as_str(), call.args.len()) {
            ("with_state" | "app_data" | "manage", 1) => {
                if let Some(arg) = call.args.first() {
                    self.root_value(arg);
                }
            }
            ("on_upgrade", 1) => {
                if let Some(Expr::Closure(closure)) = call.args.first() {
                    let body = match &*closure.body {
                        Expr::Async(block) => Some(&block.block),
                        Expr::Block(block) => Some(&block.block),
                        _ => None,
                    };
                    if let Some(block) = body {
                        self.out.per_connection.extend(constructed(block));
                    }
                }
            }
            ("rate_limit", 2) | ("concurrency_limit", 1) if on_service_builder(&call.receiver) => {
                let kind = if method == "rate_limit" {
                    Kind::InProcessRateLimit
                } else {
                    Kind::InProcessConcurrencyLimit
                };
                self.hit(
                    kind,
                    &format!("tower's `ServiceBuilder::{method}`"),
                    call.method.span(),
                );
            }
            _ => {}
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        if let Expr::Path(func) = &*call.func {
            let path = &func.path;
            let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
            let n = segments.len();
            let last = segments.last().map(String::as_str).unwrap_or_default();
            let owner = if n >= 2 { segments[n - 2].as_str() } else { "" };
            if last == "Extension"
                && call.args.len() == 1
                && let Some(arg) = call.args.first()
            {
                self.root_value(arg);
            }
            if owner.len() > "Server".len()
                && owner.ends_with("Server")
                && matches!(last, "new" | "with_interceptor" | "from_arc")
                && let Some(arg) = call.args.first()
            {
                self.root_value(arg);
            }
            // an actix websocket actor: one per connection
            if ((last == "start" && owner == "ws")
                || (owner == "WsResponseBuilder" && last == "new"))
                && let Some(arg) = call.args.first()
                && let Some(name) = self.type_name(arg, 0)
            {
                self.out.per_connection.push(name);
            }
            if matches!(last, "spawn" | "spawn_local" | "spawn_blocking")
                && let Some(arg) = call.args.first()
            {
                let block = match arg {
                    Expr::Async(block) => Some(&block.block),
                    Expr::Closure(closure) => match &*closure.body {
                        Expr::Async(block) => Some(&block.block),
                        Expr::Block(block) => Some(&block.block),
                        _ => None,
                    },
                    _ => None,
                };
                if let Some(block) = block {
                    self.task_locals(block);
                }
            }
            self.known_call(path);
            let span = path.span();
            let governor = self.uses.is_from(path, GOVERNOR_CRATES);
            let tower = self.uses.is_from(path, &["tower"]);
            match owner {
                "RateLimiter" if governor => {
                    self.hit(
                        Kind::InProcessRateLimit,
                        &format!("governor's `RateLimiter::{last}`"),
                        span,
                    );
                }
                "GovernorConfigBuilder" if governor => {
                    self.hit(Kind::InProcessRateLimit, "`GovernorConfigBuilder`", span);
                }
                "GovernorConfig" if governor && matches!(last, "default" | "secure") => {
                    self.hit(
                        Kind::InProcessRateLimit,
                        &format!("`GovernorConfig::{last}`"),
                        span,
                    );
                }
                "RateLimitLayer" | "RateLimit" if tower && last == "new" => {
                    self.hit(
                        Kind::InProcessRateLimit,
                        &format!("tower's `{owner}`"),
                        span,
                    );
                }
                "MemoryStore"
                    if self.uses.is_from(path, &["tollgate"])
                        && matches!(last, "new" | "with_capacity" | "default") =>
                {
                    self.hit(
                        Kind::InProcessStore,
                        &format!("tollgate's `MemoryStore::{last}`"),
                        span,
                    );
                }
                "ConcurrencyLimitLayer" | "ConcurrencyLimit" | "GlobalConcurrencyLimitLayer"
                    if tower =>
                {
                    self.hit(
                        Kind::InProcessConcurrencyLimit,
                        &format!("tower's `{owner}`"),
                        span,
                    );
                }
                _ => {}
            }
        }
        visit::visit_expr_call(self, call);
    }
}

/// Whether a method chain starts at `ServiceBuilder::new()`.
fn on_service_builder(mut receiver: &Expr) -> bool {
    loop {
        match receiver {
            Expr::MethodCall(call) => receiver = &call.receiver,
            Expr::Call(call) => {
                let Expr::Path(func) = &*call.func else {
                    return false;
                };
                let segments: Vec<String> = func
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let n = segments.len();
                return n >= 2 && segments[n - 2] == "ServiceBuilder";
            }
            _ => return false,
        }
    }
}

/// Reads one parsed file into the model and the collection.
pub(crate) fn collect(
    file: &syn::File,
    index: usize,
    model: &mut Model,
    out: &mut Collected,
    known: &[KnownType],
) {
    let uses = uses_of(file);
    let mut collector = Collector {
        file: index,
        uses: &uses,
        model,
        out,
        lets: Vec::new(),
        item_starts: Vec::new(),
        known,
        impl_self: None,
    };
    collector.visit_file(file);
    model.files[index].uses = uses;
    model.files[index].item_names = item_names(file);
}

/// The names of a file's items, at every depth: functions, methods, types, constants.
fn item_names(file: &syn::File) -> Vec<String> {
    struct Names(Vec<String>);
    impl<'ast> Visit<'ast> for Names {
        fn visit_ident(&mut self, ident: &'ast Ident) {
            self.0.push(ident.to_string());
        }
    }
    let mut names = Names(Vec::new());
    for item in &file.items {
        match item {
            syn::Item::Fn(f) => names.visit_ident(&f.sig.ident),
            syn::Item::Struct(s) => names.visit_ident(&s.ident),
            syn::Item::Enum(e) => names.visit_ident(&e.ident),
            syn::Item::Const(c) => names.visit_ident(&c.ident),
            syn::Item::Impl(i) => {
                for item in &i.items {
                    if let syn::ImplItem::Fn(f) = item {
                        names.visit_ident(&f.sig.ident);
                    }
                }
            }
            _ => {}
        }
    }
    names.0.sort();
    names.0.dedup();
    names.0
}
