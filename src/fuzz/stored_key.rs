//! The stored form of a caller's [`Key`], as the invalidation broadcasts carry it back: 22
//! characters of base64url, read by `Key::from_encoded`.

use proptest::prelude::*;

use super::check;
use crate::key::Key;

fn encoded(key: Key) -> String {
    let mut text = String::new();
    key.write_encoded(&mut text);
    text
}

#[test]
fn any_key_reads_back_from_its_encoded_form() {
    check(512, any::<Vec<u8>>(), |value| {
        let key = Key::new("fuzz", &value);
        prop_assert_eq!(Key::from_encoded(&encoded(key)), Some(key));
        Ok(())
    });
}

#[test]
fn any_text_reads_as_a_key_only_in_its_one_encoded_form() {
    let text = prop_oneof![".{0,40}", "[A-Za-z0-9_-]{22}", "[A-Za-z0-9+/=_-]{21,23}",];
    check(1024, text, |text| {
        if let Some(key) = Key::from_encoded(&text) {
            prop_assert_eq!(encoded(key), text);
        }
        Ok(())
    });
}

#[test]
fn a_22_character_text_with_stray_low_bits_is_refused() {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let key = Key::new("fuzz", b"stray");
    let text = encoded(key);
    // the last character carries 2 bits of the key and 4 that must be zero
    let last = ALPHABET
        .iter()
        .position(|&c| c == text.as_bytes()[21])
        .unwrap();
    let stray = format!("{}{}", &text[..21], char::from(ALPHABET[last ^ 1]));
    assert_eq!(Key::from_encoded(&stray), None);
    assert_eq!(Key::from_encoded(&text), Some(key));
}
