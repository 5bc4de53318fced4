//! Small macros shared by the middleware modules.

/// `get_ref`, `get_mut` and `into_inner` for a service whose inner service is `self.inner: S`.
macro_rules! inner_service_accessors {
    () => {
        /// The inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Unwraps the inner service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

/// A layer's service: `$name<S, K = Global>` holding its inner service, the layer's shared
/// `Settings` and its key extractor `$key: Arc<K>`, with `new`, the inner-service accessors, and
/// `Clone` and `Debug` that leave `K` and `Settings` shared.
macro_rules! layer_service {
    ($(#[$doc:meta])* $name:ident { $key:ident }) => {
        $(#[$doc])*
        pub struct $name<S, K = crate::key::Global> {
            inner: S,
            settings: std::sync::Arc<Settings>,
            $key: std::sync::Arc<K>,
        }

        impl<S, K> $name<S, K> {
            pub(crate) fn new(
                inner: S,
                settings: std::sync::Arc<Settings>,
                $key: std::sync::Arc<K>,
            ) -> Self {
                Self { inner, settings, $key }
            }

            inner_service_accessors!();
        }

        impl<S: Clone, K> Clone for $name<S, K> {
            fn clone(&self) -> Self {
                Self {
                    inner: self.inner.clone(),
                    settings: std::sync::Arc::clone(&self.settings),
                    $key: std::sync::Arc::clone(&self.$key),
                }
            }
        }

        impl<S: std::fmt::Debug, K: std::fmt::Debug> std::fmt::Debug for $name<S, K> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("inner", &self.inner)
                    .field("settings", &self.settings)
                    .field(stringify!($key), &self.$key)
                    .finish()
            }
        }
    };
}
