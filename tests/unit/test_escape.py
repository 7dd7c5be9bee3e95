"""kvstore.escape: which characters ``visible`` shows as escapes, and that the rest pass as they are."""

from __future__ import annotations

from kvstore.escape import visible

BIDI = {0x200E, 0x200F, 0x061C, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def _expected(c: int, newlines: bool) -> str:
    shown = c <= 0x1F and c != 0x09 and (c != 0x0A or not newlines) or 0x7F <= c <= 0x9F or c in BIDI
    if not shown:
        return chr(c)
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def test_visible_escapes_exactly_the_controls_on_every_code_point() -> None:
    """Every code point (surrogates aside), alone and in one string: C0 controls but tab
    (and newline unless ``newlines=False``), DEL, C1 controls and the bidirectional
    marks become escapes; everything else, unprintable or not, is left as it is. Issue
    47.5 replaced the regex run over every text with a printable check first (the regex
    is compiled only for text that has something to escape): the output must not change."""
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for newlines in (True, False):
        want = "".join(_expected(c, newlines) for c in points)
        assert visible("".join(chr(c) for c in points), newlines=newlines) == want
        wrong = [c for c in (*range(0x00, 0x300), *range(0x2000, 0x2070), 0x061C)
                 if visible(chr(c), newlines=newlines) != _expected(c, newlines)]
        assert wrong == [], wrong


def test_visible_keeps_printable_text_and_converts_other_objects() -> None:
    assert visible("naïve 日本語 text\twith tabs\nand lines") == "naïve 日本語 text\twith tabs\nand lines"
    assert visible("two\nlines", newlines=False) == "two\\x0alines"
    assert visible("\x1b]52;c;aGk=\x07 title") == "\\x1b]52;c;aGk=\\x07 title"
    assert visible(b"x\x1b") == "b'x\\x1b'" and visible(None) == "None" and visible("") == ""
