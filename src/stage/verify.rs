//! What a download is checked against: the blob version it was listed at, and the blob's
//! Content-MD5 when it has one.
//!
//! Blob Storage sends a blob's stored Content-MD5 with a whole-blob GET, but `object_store`
//! keeps only the headers it knows. [`Md5Connector`] is its HTTP client with one step added:
//! the header is put in the response's extensions, which `object_store` hands back with the
//! [`object_store::GetResult`] (its documented place for middleware's findings).

use std::future::Future;
use std::pin::Pin;

use base64::Engine;
use object_store::ClientOptions;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};

/// A blob's Content-MD5 as Blob Storage sent it (base64 of the 16 bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContentMd5(pub String);

impl ContentMd5 {
    /// The MD5 in lowercase hex, as the manifest records it; `None` when it is not 16 bytes
    /// of base64 (then there is nothing to check against).
    pub fn hex(&self) -> Option<String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(self.0.trim())
            .ok()?;
        (bytes.len() == 16).then(|| super::hex(&bytes))
    }
}

/// Whether the bytes downloaded (`got`, hex MD5) are the blob's, when it states its MD5:
/// `Err(expected hex)` when they differ.
pub fn check(stated: Option<&ContentMd5>, got: &str) -> Result<(), String> {
    match stated.and_then(ContentMd5::hex) {
        Some(expected) if expected != got => Err(expected),
        _ => Ok(()),
    }
}

/// `object_store`'s reqwest client, keeping each response's `Content-MD5` header as a
/// [`ContentMd5`] extension.
#[derive(Debug, Default)]
pub struct Md5Connector;

impl HttpConnector for Md5Connector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(KeepContentMd5(inner)))
    }
}

#[derive(Debug)]
struct KeepContentMd5(HttpClient);

impl HttpService for KeepContentMd5 {
    // `HttpService` is an `async_trait`: this is the signature it expands to.
    fn call<'a, 'f>(
        &'a self,
        request: HttpRequest,
    ) -> Pin<Box<dyn Future<Output = Result<HttpResponse, HttpError>> + Send + 'f>>
    where
        'a: 'f,
        Self: 'f,
    {
        Box::pin(async move {
            let mut response = self.0.execute(request).await?;
            let md5 = response
                .headers()
                .get("content-md5")
                .and_then(|v| v.to_str().ok())
                .map(|v| ContentMd5(v.to_string()));
            if let Some(md5) = md5 {
                response.extensions_mut().insert(md5);
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stated_md5_must_match_and_a_missing_or_malformed_one_is_no_check() {
        // MD5("hello") = 5d41402abc4b2a76b9719d911017c592.
        let good = ContentMd5("XUFAKrxLKna5cZ2REBfFkg==".into());
        assert_eq!(
            good.hex().as_deref(),
            Some("5d41402abc4b2a76b9719d911017c592")
        );
        assert_eq!(
            check(Some(&good), "5d41402abc4b2a76b9719d911017c592"),
            Ok(())
        );
        assert_eq!(
            check(Some(&good), "00000000000000000000000000000000"),
            Err("5d41402abc4b2a76b9719d911017c592".into())
        );
        assert_eq!(check(None, "0000"), Ok(()));
        assert_eq!(check(Some(&ContentMd5("not base64!".into())), "00"), Ok(()));
        assert_eq!(check(Some(&ContentMd5("AAAA".into())), "00"), Ok(()));
    }
}
