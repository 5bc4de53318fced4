//! What the audit knows of the code it reads: the structs, type aliases, statics and `use`
//! declarations of every file, and which types hold state that changes at run time.

use std::collections::HashMap;

use syn::{GenericArgument, PathArguments, Type};

use super::kind::Base;

/// The `use` declarations of one file: a name in scope to the full path it stands for.
#[derive(Debug, Default)]
pub(crate) struct Uses {
    names: HashMap<String, String>,
    globs: Vec<String>,
}

impl Uses {
    /// Adds a `use` tree.
    pub(crate) fn add(&mut self, tree: &syn::UseTree) {
        self.add_under(tree, &mut Vec::new());
    }

    fn add_under(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.add_under(&path.tree, prefix);
                prefix.pop();
            }
            syn::UseTree::Name(name) => {
                let ident = name.ident.to_string();
                if ident == "self" {
                    if let Some(last) = prefix.last() {
                        self.names.insert(last.clone(), prefix.join("::"));
                    }
                } else {
                    let mut full = prefix.clone();
                    full.push(ident.clone());
                    self.names.insert(ident, full.join("::"));
                }
            }
            syn::UseTree::Rename(rename) => {
                let mut full = prefix.clone();
                full.push(rename.ident.to_string());
                self.names
                    .insert(rename.rename.to_string(), full.join("::"));
            }
            syn::UseTree::Glob(_) => self.globs.push(prefix.join("::")),
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.add_under(tree, prefix);
                }
            }
        }
    }

    /// The path with its first segment replaced by what it was imported as, joined by `::`.
    pub(crate) fn resolve(&self, path: &syn::Path) -> String {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        let Some(first) = segments.first() else {
            return String::new();
        };
        let mut full = match self.names.get(first) {
            Some(imported) => imported.clone(),
            None => first.clone(),
        };
        for segment in &segments[1..] {
            full.push_str("::");
            full.push_str(segment);
        }
        full
    }

    /// Whether the path names something of one of `crates`: through its own segments, what
    /// its first segment was imported as, or a glob import of the crate.
    pub(crate) fn is_from(&self, path: &syn::Path, crates: &[&str]) -> bool {
        let resolved = self.resolve(path);
        let first = resolved.split("::").next().unwrap_or_default();
        let first = first.trim_start_matches("::");
        if crates.contains(&first) {
            return true;
        }
        path.segments.len() == 1
            && !self.names.contains_key(&path.segments[0].ident.to_string())
            && self.globs.iter().any(|glob| {
                let head = glob.split("::").next().unwrap_or_default();
                crates.contains(&head)
            })
    }
}

/// A place in a file: the line of the finding, and the first line of its item with the
/// item's attributes, where an allow comment may stand above.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spot {
    /// The file's index in [`Model::files`].
    pub(crate) file: usize,
    /// The 1-based line reported.
    pub(crate) line: usize,
    /// The 1-based first line of the item, attributes included.
    pub(crate) start: usize,
}

/// A field of a struct.
#[derive(Debug)]
pub(crate) struct Field {
    /// Its name, or its index for a tuple struct.
    pub(crate) name: String,
    /// Its type as written.
    pub(crate) ty: Type,
    /// Where it is.
    pub(crate) spot: Spot,
}

/// A struct of the code read.
#[derive(Debug)]
pub(crate) struct StructDef {
    /// Its name.
    pub(crate) name: String,
    /// Its fields.
    pub(crate) fields: Vec<Field>,
    /// Whether it derives `Clone` (application state is cloned into every handler).
    pub(crate) derives_clone: bool,
    /// The file it is in.
    pub(crate) file: usize,
}

/// A type alias of the code read.
#[derive(Debug)]
pub(crate) struct Alias {
    /// The type it stands for.
    pub(crate) ty: Type,
    /// Where it is.
    pub(crate) spot: Spot,
}

/// A `static`, a `lazy_static!` or a `thread_local!` entry.
#[derive(Debug)]
pub(crate) struct Static {
    /// Its name.
    pub(crate) name: String,
    /// Its type as written.
    pub(crate) ty: Type,
    /// `static mut`: all of it changes.
    pub(crate) mutable: bool,
    /// A `thread_local!`: one per thread.
    pub(crate) thread_local: bool,
    /// Where it is.
    pub(crate) spot: Spot,
}

/// A file read.
#[derive(Debug)]
pub(crate) struct SourceFile {
    /// Its path relative to the audited path, with `/`.
    pub(crate) rel: String,
    /// Its lines, for allow comments.
    pub(crate) lines: Vec<String>,
    /// Its `use` declarations.
    pub(crate) uses: Uses,
    /// The names of its items (functions, types, constants), for hints of what it does.
    pub(crate) item_names: Vec<String>,
}

/// Everything collected from the files before the findings are decided.
#[derive(Debug, Default)]
pub(crate) struct Model {
    /// The files read.
    pub(crate) files: Vec<SourceFile>,
    /// The structs by name (several crates may have one of a name).
    pub(crate) structs: HashMap<String, Vec<StructDef>>,
    /// The type aliases by name.
    pub(crate) aliases: HashMap<String, Vec<Alias>>,
}

/// The deepest the type walks go: aliases and structs may refer to each other.
const MAX_DEPTH: u8 = 12;

/// Wrappers that hand their content on unchanged: a lock inside is still a lock.
const TRANSPARENT: &[&str] = &[
    "Arc",
    "Rc",
    "Box",
    "Option",
    "Weak",
    "Pin",
    "Lazy",
    "LazyLock",
    "LazyCell",
    "OnceLock",
    "OnceCell",
    "CachePadded",
    "ManuallyDrop",
];

/// Types that let shared code change what they hold.
const LOCKS: &[&str] = &[
    "Mutex",
    "RwLock",
    "ReentrantMutex",
    "FairMutex",
    "RefCell",
    "Cell",
    "UnsafeCell",
    "AtomicCell",
    "AtomicRefCell",
];

/// Maps and sets that change only behind a lock.
const MAPS: &[&str] = &[
    "HashMap",
    "HashSet",
    "BTreeMap",
    "BTreeSet",
    "IndexMap",
    "IndexSet",
    "AHashMap",
    "AHashSet",
    "FxHashMap",
    "FxHashSet",
    "FnvHashMap",
    "FnvHashSet",
    "LinkedHashMap",
    "LinkedHashSet",
    "Slab",
    "SlotMap",
];

/// Maps and sets that change through a shared reference.
const CONCURRENT_MAPS: &[&str] = &[
    "DashMap",
    "DashSet",
    "SkipMap",
    "SkipSet",
    "ConcurrentHashMap",
    "ConcurrentMap",
    "CHashMap",
];

/// The crates whose `HashMap`, `HashSet` and indexes are concurrent.
const CONCURRENT_MAP_CRATES: &[&str] = &["flurry", "papaya", "scc", "evmap", "dashmap"];

/// Caches that change only behind a lock.
const CACHES: &[&str] = &[
    "LruCache",
    "LruMap",
    "CLruCache",
    "TtlCache",
    "TimedCache",
    "SizedCache",
    "TimedSizedCache",
    "ExpiringMap",
];

/// The crates of caches that change through a shared reference.
const CACHE_CRATES: &[&str] = &[
    "moka",
    "mini_moka",
    "quick_cache",
    "stretto",
    "foyer",
    "retainer",
    "cached",
];

/// Atomic integers: counters.
const ATOMIC_INTEGERS: &[&str] = &[
    "AtomicU8",
    "AtomicU16",
    "AtomicU32",
    "AtomicU64",
    "AtomicUsize",
    "AtomicI8",
    "AtomicI16",
    "AtomicI32",
    "AtomicI64",
    "AtomicIsize",
];

/// Integers: behind a lock, counters.
const INTEGERS: &[&str] = &[
    "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize",
];

/// Ends of type names for what a lock guards without being state that must hold across
/// copies: connections and clients, channels, handles, files, random generators, compiled
/// regular expressions, and configuration reloaded in each copy.
const RESOURCE_SUFFIXES: &[&str] = &[
    "Client",
    "Connection",
    "Conn",
    "Pool",
    "Sender",
    "Receiver",
    "Handle",
    "Stream",
    "Sink",
    "Writer",
    "Reader",
    "Rng",
    "Socket",
    "Listener",
    "Child",
    "File",
    "Stdin",
    "Stdout",
    "Stderr",
    "Interval",
    "Transaction",
    "Config",
    "Configuration",
    "Settings",
    "Options",
    "Notify",
    "Watcher",
    "Logger",
    "PhantomData",
    "JoinSet",
    "Regex",
    "RegexSet",
    "Repository",
    "Mailer",
    "Transport",
    "Operator",
];

/// What a lock guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contents {
    /// A map, set or cache.
    Collection(Base),
    /// An integer.
    Counter,
    /// A connection, a channel, a handle, configuration, a flag: not state across requests.
    Resource,
    /// Anything else: a value that changes.
    Data,
}

/// The last segment of a path type, with its type arguments.
fn last_segment(ty: &Type) -> Option<(&syn::Path, String, Vec<&Type>)> {
    let Type::Path(path) = ty else {
        return None;
    };
    let segment = path.path.segments.last()?;
    let args = match &segment.arguments {
        PathArguments::AngleBracketed(args) => args
            .args
            .iter()
            .filter_map(|arg| match arg {
                GenericArgument::Type(ty) => Some(ty),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    Some((&path.path, segment.ident.to_string(), args))
}

/// Whether a type name says it is a resource: a client, a pool, a connection, a channel end,
/// a handle, configuration (see [`RESOURCE_SUFFIXES`]).
pub(crate) fn is_resource(name: &str) -> bool {
    RESOURCE_SUFFIXES
        .iter()
        .any(|suffix| name.ends_with(suffix))
}

/// The classification of types, in the context of one file's `use` declarations.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Types<'a> {
    model: &'a Model,
    file: usize,
}

impl<'a> Types<'a> {
    /// The types as seen from `file`.
    pub(crate) fn new(model: &'a Model, file: usize) -> Self {
        Types { model, file }
    }

    fn uses(&self) -> &'a Uses {
        &self.model.files[self.file].uses
    }

    /// Whether a path names something of `krate`, as imported in this file.
    pub(crate) fn is_from(&self, path: &syn::Path, krate: &str) -> bool {
        self.uses().is_from(path, &[krate])
    }

    fn is_concurrent_map(&self, path: &syn::Path, name: &str) -> bool {
        CONCURRENT_MAPS.contains(&name)
            || (matches!(name, "HashMap" | "HashSet" | "HashIndex" | "TreeIndex")
                && self.uses().is_from(path, CONCURRENT_MAP_CRATES))
    }

    fn is_shared_cache(&self, path: &syn::Path, name: &str) -> bool {
        name.ends_with("Cache") && self.uses().is_from(path, CACHE_CRATES)
    }

    /// What a type in shared state (a field, a static, a `State<T>`) lets the code change at
    /// run time: a lock and what it guards, a concurrent map, a cache, an atomic counter, a
    /// semaphore. `None` for what is read-only or unknown. A struct of the code read is `None`
    /// here: its own fields are examined where it is declared.
    pub(crate) fn shared(&self, ty: &Type) -> Option<Base> {
        self.shared_at(ty, 0)
    }

    /// What a type changed as a whole (a `static mut`) holds: as [`shared`](Self::shared) for
    /// a lock around it.
    pub(crate) fn guarded(&self, ty: &Type) -> Option<Base> {
        match self.contents_at(ty, 0) {
            Contents::Collection(base) => Some(base),
            Contents::Counter => Some(Base::Counter),
            Contents::Resource => None,
            Contents::Data => Some(Base::Lock),
        }
    }

    /// What a type owned by a task or an actor (changed through `&mut self`) holds: a
    /// collection, a counter; `None` for a resource, a flag or plain data.
    pub(crate) fn owned(&self, ty: &Type) -> Option<Base> {
        if let Some(base) = self.shared(ty) {
            return Some(base);
        }
        // a struct of the code read (through `Arc`, an alias): its fields are examined where
        // it is declared
        let inner = unwrap_shared(ty);
        if self.is_struct(inner)
            || self
                .alias(inner)
                .is_some_and(|(_, alias)| self.is_struct(unwrap_shared(&alias.ty)))
        {
            return None;
        }
        match self.contents_at(ty, 0) {
            Contents::Collection(base) => Some(base),
            Contents::Counter => Some(Base::Counter),
            Contents::Resource | Contents::Data => None,
        }
    }

    /// Whether a type is the sending end of a broadcast or watch channel (tokio's, or
    /// `async_broadcast`), through `Arc` and `Option`.
    pub(crate) fn is_broadcast(&self, ty: &Type) -> bool {
        let mut found = false;
        walk_paths(ty, &mut |path| {
            let resolved = self.uses().resolve(path);
            if resolved.ends_with("broadcast::Sender")
                || resolved.ends_with("watch::Sender")
                || resolved.starts_with("async_broadcast::Sender")
            {
                found = true;
            }
        });
        found
    }

    /// Whether a type is a cache: of a cache crate, or one of the known cache types.
    pub(crate) fn is_cache_type(&self, ty: &Type) -> bool {
        let mut found = false;
        walk_paths(ty, &mut |path| {
            if let Some(last) = path.segments.last() {
                let name = last.ident.to_string();
                if CACHES.contains(&name.as_str()) || self.is_shared_cache(path, &name) {
                    found = true;
                }
            }
        });
        found
    }

    fn shared_at(&self, ty: &Type, depth: u8) -> Option<Base> {
        if depth > MAX_DEPTH {
            return None;
        }
        match ty {
            Type::Reference(reference) => self.shared_at(&reference.elem, depth + 1),
            Type::Paren(paren) => self.shared_at(&paren.elem, depth + 1),
            Type::Group(group) => self.shared_at(&group.elem, depth + 1),
            Type::Array(array) => self.shared_at(&array.elem, depth + 1),
            Type::Slice(slice) => self.shared_at(&slice.elem, depth + 1),
            Type::Tuple(tuple) => tuple
                .elems
                .iter()
                .find_map(|elem| self.shared_at(elem, depth + 1)),
            Type::Path(_) => {
                let (path, name, args) = last_segment(ty)?;
                let name = name.as_str();
                if TRANSPARENT.contains(&name) {
                    return args.first().and_then(|arg| self.shared_at(arg, depth + 1));
                }
                if LOCKS.contains(&name) {
                    let guarded = args
                        .first()
                        .map_or(Contents::Data, |arg| self.contents_at(arg, depth + 1));
                    return match guarded {
                        Contents::Collection(base) => Some(base),
                        Contents::Counter => Some(Base::Counter),
                        Contents::Resource => None,
                        Contents::Data => Some(Base::Lock),
                    };
                }
                if ATOMIC_INTEGERS.contains(&name) {
                    return Some(Base::Counter);
                }
                if self.is_concurrent_map(path, name) || self.is_shared_cache(path, name) {
                    // a map of clients or connections is a pool: each copy has its own; a map
                    // of senders is a registry of subscribers, judged by its use
                    if args.last().is_some_and(|value| {
                        self.contents_at(value, depth + 1) == Contents::Resource
                            && !holds_senders(value)
                    }) {
                        return None;
                    }
                    return Some(if self.is_shared_cache(path, name) {
                        Base::Cache
                    } else {
                        Base::Map
                    });
                }
                if name == "Semaphore" && !self.model.structs.contains_key(name) {
                    return Some(Base::Semaphore);
                }
                if path.segments.len() == 1 {
                    if let Some(aliases) = self.model.aliases.get(name) {
                        return aliases.iter().find_map(|alias| {
                            Types::new(self.model, alias.spot.file).shared_at(&alias.ty, depth + 1)
                        });
                    }
                    if self.model.structs.contains_key(name) {
                        return None;
                    }
                }
                if is_resource(name) {
                    return None;
                }
                // a container of locks: a map of per-key mutexes, a list of semaphores
                args.iter().find_map(|arg| self.shared_at(arg, depth + 1))
            }
            _ => None,
        }
    }

    fn contents_at(&self, ty: &Type, depth: u8) -> Contents {
        if depth > MAX_DEPTH {
            return Contents::Data;
        }
        match ty {
            Type::Reference(reference) => self.contents_at(&reference.elem, depth + 1),
            Type::Paren(paren) => self.contents_at(&paren.elem, depth + 1),
            Type::Group(group) => self.contents_at(&group.elem, depth + 1),
            Type::Tuple(tuple) => self.fold_tuple(tuple.elems.iter(), depth),
            Type::Path(_) => {
                let Some((path, name, args)) = last_segment(ty) else {
                    return Contents::Data;
                };
                let name = name.as_str();
                if TRANSPARENT.contains(&name) || LOCKS.contains(&name) {
                    return args
                        .first()
                        .map_or(Contents::Data, |arg| self.contents_at(arg, depth + 1));
                }
                let map = MAPS.contains(&name) || self.is_concurrent_map(path, name);
                let cache = CACHES.contains(&name) || self.is_shared_cache(path, name);
                if map || cache {
                    // a map of clients or connections is a pool: each copy has its own; a map
                    // of senders is a registry of subscribers, judged by its use
                    if args.last().is_some_and(|value| {
                        self.contents_at(value, depth + 1) == Contents::Resource
                            && !holds_senders(value)
                    }) {
                        return Contents::Resource;
                    }
                    return Contents::Collection(if cache { Base::Cache } else { Base::Map });
                }
                if INTEGERS.contains(&name) || ATOMIC_INTEGERS.contains(&name) {
                    return Contents::Counter;
                }
                if name == "bool" || name == "AtomicBool" {
                    return Contents::Resource;
                }
                // the name says what it is, even for a struct of the code read (`Config`, `DbPool`)
                if is_resource(name) {
                    return Contents::Resource;
                }
                if path.segments.len() == 1 {
                    if let Some(aliases) = self.model.aliases.get(name)
                        && let Some(alias) = aliases.first()
                    {
                        return Types::new(self.model, alias.spot.file)
                            .contents_at(&alias.ty, depth + 1);
                    }
                    if let Some(structs) = self.model.structs.get(name)
                        && let Some(def) = structs.first()
                    {
                        if def.fields.is_empty() {
                            return Contents::Data;
                        }
                        return self.fold(def.fields.iter().map(|f| &f.ty), def.file, depth);
                    }
                }
                if !args.is_empty()
                    && args
                        .iter()
                        .all(|arg| self.contents_at(arg, depth + 1) == Contents::Resource)
                {
                    return Contents::Resource;
                }
                Contents::Data
            }
            _ => Contents::Data,
        }
    }

    /// What a struct or a tuple guards as a whole: a collection if any part is one, a
    /// resource only if every part is one.
    fn fold<'t>(&self, types: impl Iterator<Item = &'t Type>, file: usize, depth: u8) -> Contents {
        let inner = Types::new(self.model, file);
        let parts: Vec<Contents> = types.map(|ty| inner.contents_at(ty, depth + 1)).collect();
        if parts.is_empty() {
            return Contents::Data;
        }
        if let Some(collection) = parts
            .iter()
            .find(|part| matches!(part, Contents::Collection(_)))
        {
            return *collection;
        }
        if parts.iter().all(|part| *part == Contents::Resource) {
            return Contents::Resource;
        }
        Contents::Data
    }

    /// What a tuple guards: as [`fold`](Self::fold), with strings beside a resource taken as
    /// its description (`(String, Regex)`: a pattern and its compiled form).
    fn fold_tuple<'t>(&self, types: impl Iterator<Item = &'t Type>, depth: u8) -> Contents {
        let types: Vec<&Type> = types.collect();
        let is_string = |ty: &&Type| {
            last_segment(ty).is_some_and(|(_, name, _)| matches!(name.as_str(), "String" | "str"))
        };
        let others: Vec<&Type> = types.iter().copied().filter(|ty| !is_string(ty)).collect();
        if !others.is_empty()
            && others.len() < types.len()
            && self.fold(others.iter().copied(), self.file, depth) == Contents::Resource
        {
            return Contents::Resource;
        }
        self.fold(types.into_iter(), self.file, depth)
    }

    /// The names of the structs of the code read that a type refers to, through aliases too.
    pub(crate) fn struct_refs(&self, ty: &Type, out: &mut Vec<String>) {
        self.struct_refs_at(ty, out, 0);
    }

    fn struct_refs_at(&self, ty: &Type, out: &mut Vec<String>, depth: u8) {
        if depth > MAX_DEPTH {
            return;
        }
        struct Paths<'v>(Vec<&'v syn::Path>);
        impl<'v> syn::visit::Visit<'v> for Paths<'v> {
            fn visit_path(&mut self, path: &'v syn::Path) {
                self.0.push(path);
                syn::visit::visit_path(self, path);
            }
        }
        let mut paths = Paths(Vec::new());
        syn::visit::Visit::visit_type(&mut paths, ty);
        for path in paths.0 {
            let Some(segment) = path.segments.last() else {
                continue;
            };
            let name = segment.ident.to_string();
            if self.model.structs.contains_key(&name) && !out.contains(&name) {
                out.push(name.clone());
            }
            if path.segments.len() == 1
                && let Some(aliases) = self.model.aliases.get(&name)
            {
                for alias in aliases {
                    Types::new(self.model, alias.spot.file).struct_refs_at(
                        &alias.ty,
                        out,
                        depth + 1,
                    );
                }
            }
        }
    }

    /// The alias a type names, if it is one of the code read.
    pub(crate) fn alias<'m>(&self, ty: &Type) -> Option<(&'m str, &'m Alias)>
    where
        'a: 'm,
    {
        let (path, name, _) = last_segment(ty)?;
        if path.segments.len() != 1 {
            return None;
        }
        let (key, aliases) = self.model.aliases.get_key_value(&name)?;
        Some((key.as_str(), aliases.first()?))
    }

    /// Whether a type is an `Arc<..>`, written so or through an alias.
    pub(crate) fn is_arc(&self, ty: &Type) -> bool {
        match last_segment(ty) {
            Some((_, name, _)) if name == "Arc" => true,
            Some(_) => self.alias(ty).is_some_and(
                |(_, alias)| matches!(last_segment(&alias.ty), Some((_, name, _)) if name == "Arc"),
            ),
            None => false,
        }
    }

    /// Whether a type names a struct of the code read.
    pub(crate) fn is_struct(&self, ty: &Type) -> bool {
        last_segment(ty).is_some_and(|(_, name, _)| self.model.structs.contains_key(&name))
    }
}

/// Whether a name is the sending end of a channel or a connection's handle: what a registry
/// of subscribers holds (`Sender`, `Sink`, `Recipient`, actix `Addr`, a websocket).
pub(crate) fn is_sender_name(name: &str) -> bool {
    name.ends_with("Sender")
        || name.ends_with("Sink")
        || name.ends_with("Tx")
        || name.ends_with("Recipient")
        || name == "Addr"
        || name.ends_with("WebSocket")
}

/// Whether a type holds senders (see [`is_sender_name`]).
fn holds_senders(ty: &Type) -> bool {
    type_names(ty).iter().any(|n| is_sender_name(n))
}

/// Calls `f` on every path in a type.
pub(crate) fn walk_paths(ty: &Type, f: &mut dyn FnMut(&syn::Path)) {
    struct Paths<'f>(&'f mut dyn FnMut(&syn::Path));
    impl<'v> syn::visit::Visit<'v> for Paths<'_> {
        fn visit_path(&mut self, path: &'v syn::Path) {
            (self.0)(path);
            syn::visit::visit_path(self, path);
        }
    }
    syn::visit::Visit::visit_type(&mut Paths(f), ty);
}

/// The names of the type's path segments, outermost first.
pub(crate) fn type_names(ty: &Type) -> Vec<String> {
    let mut names = Vec::new();
    walk_paths(ty, &mut |path| {
        for segment in &path.segments {
            names.push(segment.ident.to_string());
        }
    });
    names
}

/// Whether a name is one of the locks.
pub(crate) fn is_lock(name: &str) -> bool {
    LOCKS.contains(&name) || name == "Semaphore"
}

/// Whether a name is one of the maps, sets or caches.
pub(crate) fn is_collection(name: &str) -> bool {
    MAPS.contains(&name)
        || CONCURRENT_MAPS.contains(&name)
        || CACHES.contains(&name)
        || name.ends_with("Cache")
}

/// Strips references and the wrappers an application's state comes in (`Arc`, `Box`, …).
pub(crate) fn unwrap_shared(ty: &Type) -> &Type {
    match ty {
        Type::Reference(reference) => unwrap_shared(&reference.elem),
        Type::Paren(paren) => unwrap_shared(&paren.elem),
        Type::Group(group) => unwrap_shared(&group.elem),
        _ => match last_segment(ty) {
            Some((_, name, args))
                if matches!(name.as_str(), "Arc" | "Rc" | "Box") && args.len() == 1 =>
            {
                unwrap_shared(args[0])
            }
            _ => ty,
        },
    }
}

/// A type as the reader wrote it, shortened: `Arc<Mutex<HashMap<..>>>`.
pub(crate) fn show(ty: &Type) -> String {
    show_at(ty, 0)
}

impl Types<'_> {
    /// A type as [`show`] writes it, followed by what it stands for when it is an alias:
    /// `` SharedState` (`Arc<RwLock<State>>`) ``, without the outer backquotes.
    pub(crate) fn describe(&self, ty: &Type) -> String {
        match self.alias(ty) {
            Some((_, alias)) => format!("{}` = `{}", show(ty), show(&alias.ty)),
            None => show(ty),
        }
    }
}

fn show_at(ty: &Type, level: u8) -> String {
    if level > 2 {
        return "..".to_owned();
    }
    match ty {
        Type::Reference(reference) => format!("&{}", show_at(&reference.elem, level)),
        Type::Paren(paren) => show_at(&paren.elem, level),
        Type::Group(group) => show_at(&group.elem, level),
        Type::Tuple(tuple) => {
            let elems: Vec<String> = tuple.elems.iter().map(|e| show_at(e, level + 1)).collect();
            format!("({})", elems.join(", "))
        }
        Type::Path(path) => {
            let Some(segment) = path.path.segments.last() else {
                return String::new();
            };
            let mut out = segment.ident.to_string();
            if let PathArguments::AngleBracketed(args) = &segment.arguments {
                let shown: Vec<String> = args
                    .args
                    .iter()
                    .filter_map(|arg| match arg {
                        GenericArgument::Type(ty) => Some(show_at(ty, level + 1)),
                        _ => None,
                    })
                    .collect();
                if !shown.is_empty() {
                    let shown = if shown.iter().all(|s| s == "..") {
                        vec!["..".to_owned()]
                    } else {
                        shown
                    };
                    out.push('<');
                    out.push_str(&shown.join(", "));
                    out.push('>');
                }
            }
            out
        }
        other => quote::ToTokens::to_token_stream(other)
            .to_string()
            .replace(" < ", "<")
            .replace(" >", ">")
            .replace(" ,", ","),
    }
}
