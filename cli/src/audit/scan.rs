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
}

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
}

impl Collector<'_> {
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
        let message = match kind {
            Kind::InProcessConcurrencyLimit => format!(
                "an in-process concurrency limit ({what}): each copy has its own permits, so N \
                 copies let N times as many requests in at once"
            ),
            Kind::InProcessStore => format!(
                "an in-process store ({what}): each copy keeps its own counters, claims and \
                 records, so N copies admit N times, redeem N times and run a keyed request N \
                 times"
            ),
            _ => format!(
                "an in-process rate limiter ({what}): each copy counts on its own, so N copies \
                 let a caller through N times as often"
            ),
        };
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
        self.lets.push(bindings_of(&item.block));
        self.with_item(line(item.span()), |this| visit::visit_item_fn(this, item));
        self.lets.pop();
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if is_test_only(&item.attrs) {
            return;
        }
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
        visit::visit_item_impl(self, item);
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
pub(crate) fn collect(file: &syn::File, index: usize, model: &mut Model, out: &mut Collected) {
    let uses = uses_of(file);
    let mut collector = Collector {
        file: index,
        uses: &uses,
        model,
        out,
        lets: Vec::new(),
        item_starts: Vec::new(),
    };
    collector.visit_file(file);
    model.files[index].uses = uses;
}
