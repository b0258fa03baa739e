"""Kubernetes quantities: every form apimachinery's resource.Quantity accepts, checked against a
reference written separately from the grammar (decimal arithmetic, a hand-written scanner),
with examples and property-based tests."""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.quantity import (
    QuantityError,
    milli_value,
    parse_quantity,
    value,
    whole_number,
)

# -- the reference: apimachinery's grammar, read character by character --------------------
#
#   <quantity>        ::= <signedNumber><suffix>
#   <signedNumber>    ::= <number> | <sign><number>
#   <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
#   <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
#   <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
#   <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
#   <decimalExponent> ::= "e" <sign?><digits> | "E" <sign?><digits>
#
# The value is rounded up (away from zero) to whole nanos, as ParseQuantity does.

_CONTEXT = decimal.Context(prec=400, Emax=10**6, Emin=-(10**6))
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
ASCII_DIGITS = "0123456789"


def _digits(text: str, at: int) -> int:
    end = at
    while end < len(text) and text[end] in ASCII_DIGITS:
        end += 1
    return end


def reference(text: str) -> Fraction | None:
    """The quantity's exact value, or None when the grammar does not produce `text`."""
    at = 0
    negative = False
    if text[:1] in ("+", "-"):
        negative = text[0] == "-"
        at = 1
    whole_end = _digits(text, at)
    whole = text[at:whole_end]
    fraction = ""
    at = whole_end
    if text[at : at + 1] == ".":
        fraction_end = _digits(text, at + 1)
        fraction = text[at + 1 : fraction_end]
        at = fraction_end
    if not whole and not fraction:
        return None
    number = decimal.Decimal(f"{whole or '0'}.{fraction or '0'}")
    suffix = text[at:]
    if suffix in _BINARY:
        amount = _CONTEXT.multiply(number, decimal.Decimal(1024) ** _BINARY[suffix])
    elif suffix in _DECIMAL:
        amount = number.scaleb(_DECIMAL[suffix], _CONTEXT)
    elif suffix[:1] in ("e", "E"):
        rest = suffix[1:]
        sign = 1
        if rest[:1] in ("+", "-"):
            sign = -1 if rest[0] == "-" else 1
            rest = rest[1:]
        if not rest or _digits(rest, 0) != len(rest):
            return None
        exponent = sign * int(rest)
        if number and exponent > 60:
            return Fraction(10**61) * (-1 if negative else 1)  # beyond any int64: refused
        if number and exponent < -60:
            return Fraction(1, 10**9) * (-1 if negative else 1)  # rounds up to one nano
        amount = number.scaleb(max(exponent, -60), _CONTEXT)
    else:
        return None
    nanos = _CONTEXT.multiply(amount, decimal.Decimal(10**9)).to_integral_value(
        rounding=decimal.ROUND_CEILING
    )
    result = Fraction(int(nanos), 10**9)
    return -result if negative else result


# -- examples ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "exact", "whole", "milli"),
    [
        ("4k", 4000, 4000, 4_000_000),
        ("4000", 4000, 4000, 4_000_000),
        ("1Ki", 1024, 1024, 1_024_000),
        ("1.5Gi", 1536 * 1024**2, 1536 * 1024**2, 1536 * 1024**2 * 1000),
        ("0.5", Fraction(1, 2), 1, 500),
        ("500m", Fraction(1, 2), 1, 500),
        ("1e3", 1000, 1000, 1_000_000),
        ("1E3", 1000, 1000, 1_000_000),
        ("1e+3", 1000, 1000, 1_000_000),
        ("12e-3", Fraction(12, 1000), 1, 12),
        ("1E", 10**18, 10**18, 10**21),
        ("+1", 1, 1, 1000),
        (".5", Fraction(1, 2), 1, 500),
        ("5.", 5, 5, 5000),
        ("0.1m", Fraction(1, 10_000), 1, 1),
        ("1n", Fraction(1, 10**9), 1, 1),
        ("1u", Fraction(1, 10**6), 1, 1),
        ("1e-12", Fraction(1, 10**9), 1, 1),  # rounded up to one nano, as Kubernetes does
        ("0", 0, 0, 0),
        ("000", 0, 0, 0),
        ("-0", 0, 0, 0),
        ("0e99999999999", 0, 0, 0),  # zero at any exponent (this once hung, raising 10 to it)
        ("0." + "0" * 60 + "1e65", 10_000, 10_000, 10_000_000),  # a tiny mantissa, a big power
    ],
)
def test_every_form_kubernetes_writes(text: str, exact: Fraction, whole: int, milli: int) -> None:
    amount = parse_quantity(text)
    assert amount == exact
    assert (value(amount), milli_value(amount)) == (whole, milli)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("1K", "unknown suffix 'K'"),
        ("1ki", "unknown suffix 'ki'"),
        ("1e", "unknown suffix 'e'"),
        ("e3", "no digits"),
        ("1e3.5", "unknown suffix"),
        ("1e1.5", "unknown suffix"),
        ("1Mi3", "unknown suffix"),
        (" 1", "no digits"),
        ("1 ", "unknown suffix ' '"),
        ("--1", "no digits"),
        ("+", "no digits"),
        (".", "no digits"),
        ("1..2", "unknown suffix"),
        ("\u0661", "not ASCII"),
        ("4\u0664", "not ASCII"),
        ("4k\n", "unknown suffix"),
        ("1e100", "larger than a quantity can hold"),
        ("99999999999Ei", "larger than a quantity can hold"),
        ("1" * 101, "at most 100"),
        ("inf", "no digits"),
    ],
)
def test_malformed_quantities_say_why(text: str, problem: str) -> None:
    with pytest.raises(QuantityError, match=problem.replace(".", r"\.")):
        parse_quantity(text)


def test_json_numbers_and_other_types() -> None:
    assert parse_quantity(2) == 2
    assert parse_quantity(0.5) == Fraction(1, 2)
    assert parse_quantity(1e15) == 10**15
    for bad in (True, None, [1], {"a": 1}, float("nan"), float("inf")):
        with pytest.raises(QuantityError):
            parse_quantity(bad)


def test_whole_numbers_name_the_field() -> None:
    assert whole_number("2.5k", "limits[nvidia.com/gpumem]") == 2500
    with pytest.raises(QuantityError, match=r"^limits\[x\]: must not be negative"):
        whole_number("-1", "limits[x]")
    with pytest.raises(QuantityError, match=r"^limits\[x\]: '\u0663' has characters that are not"):
        whole_number("\u0663", "limits[x]")


# -- properties ----------------------------------------------------------------------------

digits = st.text(ASCII_DIGITS, min_size=1, max_size=12)
numbers = st.one_of(
    digits,
    st.tuples(digits, digits).map(lambda p: f"{p[0]}.{p[1]}"),
    digits.map(lambda d: f"{d}."),
    digits.map(lambda d: f".{d}"),
)
signs = st.sampled_from(["", "+", "-"])
suffixes = st.one_of(
    st.sampled_from([*_DECIMAL, *_BINARY]),
    st.tuples(st.sampled_from("eE"), signs, st.integers(0, 40)).map(
        lambda p: f"{p[0]}{p[1]}{p[2]}"
    ),
)
quantities = st.tuples(signs, numbers, suffixes).map("".join)


@given(quantities)
def test_the_grammar_s_quantities_parse_exactly_as_the_reference(text: str) -> None:
    expected = reference(text)
    assert expected is not None
    if abs(expected) > 2**63 - 1:
        with pytest.raises(QuantityError, match="larger than a quantity can hold"):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == expected


alphabet = st.sampled_from([*"0123456789+-.eEinumkKMGTP ", "\u0663", "\uff10", "x"])


@given(st.text(alphabet, max_size=12))
def test_any_text_is_accepted_exactly_when_the_grammar_produces_it(text: str) -> None:
    expected = reference(text) if text else None
    if expected is None or abs(expected) > 2**63 - 1:
        with pytest.raises(QuantityError):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == expected


@given(st.text(min_size=1, max_size=20).filter(lambda t: not t.isascii()))
def test_anything_not_ascii_is_refused(text: str) -> None:
    with pytest.raises(QuantityError, match="not ASCII"):
        parse_quantity(text)


@given(st.integers(0, 2**40), st.sampled_from(["", "k", "M", "Ki", "Mi", "m", "e2", "E-1"]))
def test_value_rounds_up_as_quantity_value_does(number: int, suffix: str) -> None:
    amount = parse_quantity(f"{number}{suffix}")
    assert value(amount) == math.ceil(amount)
    assert amount <= value(amount) < amount + 1
    assert milli_value(amount) == math.ceil(amount * 1000)
