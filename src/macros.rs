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

/// A layer's public response body `$name<B>`: a [`LayerBody`](crate::body::LayerBody) and a
/// `$tap` field that sees every frame as it goes out ([`Tap`](crate::body::Tap)), with
/// `From<Complete>` and `Default` (a complete body, the tap at its default) and `Body`.
macro_rules! tapped_body {
    ($(#[$doc:meta])* $name:ident { $tap:ident: $tap_type:ty }) => {
        pin_project_lite::pin_project! {
            $(#[$doc])*
            #[derive(Debug)]
            pub struct $name<B> {
                #[pin]
                body: crate::body::LayerBody<B>,
                $tap: $tap_type,
            }
        }

        impl<B> From<crate::body::Complete> for $name<B> {
            fn from(body: crate::body::Complete) -> Self {
                Self {
                    body: body.into(),
                    $tap: Default::default(),
                }
            }
        }

        impl<B> Default for $name<B> {
            fn default() -> Self {
                crate::body::Complete::default().into()
            }
        }

        impl<B> http_body::Body for $name<B>
        where
            B: http_body::Body<Data = bytes::Bytes>,
        {
            type Data = bytes::Bytes;
            type Error = B::Error;

            fn poll_frame(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
                let this = self.project();
                let frame = this.body.poll_frame(cx);
                crate::body::Tap::frame(this.$tap, &frame);
                frame
            }

            fn is_end_stream(&self) -> bool {
                self.body.is_end_stream()
            }

            fn size_hint(&self) -> http_body::SizeHint {
                self.body.size_hint()
            }
        }
    };
}

/// `Debug` for `$name` that shows the fields named, each under its own name, and `..` for the
/// rest (closures, caches and handles with nothing to show).
macro_rules! debug_fields {
    ($name:ident $(<$param:ident>)? { $($field:ident),* $(,)? }) => {
        impl$(<$param: std::fmt::Debug>)? std::fmt::Debug for $name$(<$param>)? {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    $(.field(stringify!($field), &self.$field))*
                    .finish_non_exhaustive()
            }
        }
    };
}
