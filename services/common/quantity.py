"""Kubernetes quantities (apimachinery's resource.Quantity), read as the API server reads them.

Every request vgpu reads (GPU counts, MiB, percentages, CPU, memory) is a quantity, and the
API server stores quantities in canonical form: ``4000`` comes back as ``"4k"``, ``1.5`` as
``"1500m"``, ``1024`` MiB of memory as ``"1Gi"``, ``1e3`` stays ``"1e3"``. The grammar:

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>       <sign> ::= "+" | "-"
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>   (an integer exponent)

Digits are ASCII only (Python's ``isdigit`` would take "٣"). Values are exact (Fractions);
as Kubernetes does, a value is first rounded up to whole nanos, and ``value`` rounds up to a
whole number (Quantity.Value()), ``milli_value`` to whole thousandths (MilliValue()). Go's
scanner also takes a bare sign or dot ("+", ".") as zero; that is outside the grammar and the
API server never stores it, so it is refused here. Values above 2^63-1 are refused.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction

MAX_QUANTITY = 2**63 - 1
NANO = Fraction(1, 10**9)
MAX_TEXT = 100  # longer strings are refused before any arithmetic

DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
                    "E": 18}  # fmt: skip
BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
# Beyond these exponents a non-zero value is either too large or rounds up to one nano: the
# exact power is never needed (and 1e999999999 must not make us compute it). A mantissa of at
# most MAX_TEXT characters lies within 10^+-MAX_TEXT, so the bound leaves room for it:
# "0.(60 zeros)1e65" is 10^4, exactly.
_EXPONENT_BOUND = 64 + MAX_TEXT

_NUMBER = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(.*)", re.ASCII | re.DOTALL)
_EXPONENT = re.compile(r"[eE]([+-]?[0-9]+)", re.ASCII)


class QuantityError(ValueError):
    """Not a Kubernetes quantity, or one out of range; the message says what is wrong."""


def parse_quantity(value: object) -> Fraction:
    """The exact value of a quantity given as a string (or a JSON number), rounded up to nanos."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise QuantityError(f"expected a quantity such as 4, 4k, 1Ki or 500m, got {value!r}")
    if isinstance(value, int):
        amount = Fraction(value)
    else:
        text = value if isinstance(value, str) else repr(value)
        amount = _parse_text(text)
    if abs(amount) > MAX_QUANTITY:
        raise QuantityError(f"{value!r} is larger than a quantity can hold (2^63-1)")
    return amount


# Pure, and the same few strings ("4000m", "16Gi", "1") arrive with every pod: memoised
# (a refusal raises each time; only values are kept).
@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Fraction:
    if not text:
        raise QuantityError("an empty string is not a quantity")
    if len(text) > MAX_TEXT:
        raise QuantityError(f"{text[:20]!r}... is {len(text)} characters long; a quantity has "
                            f"at most {MAX_TEXT}")  # fmt: skip
    if not text.isascii():
        raise QuantityError(f"{text!r} has characters that are not ASCII (digits must be 0-9)")
    match = _NUMBER.fullmatch(text)
    assert match is not None  # every part is optional
    sign, whole, fraction, suffix = match.groups()
    fraction = fraction or ""
    if not whole and not fraction:
        raise QuantityError(f"{text!r} is not a quantity: it has no digits before its suffix")
    mantissa = Fraction(int(whole or "0") * 10 ** len(fraction) + int(fraction or "0"),
                        10 ** len(fraction))  # fmt: skip
    if suffix in DECIMAL_SUFFIXES:
        amount = _scaled(mantissa, 10, DECIMAL_SUFFIXES[suffix])
    elif suffix in BINARY_SUFFIXES:
        amount = mantissa * 2 ** BINARY_SUFFIXES[suffix]
    else:
        exponent = _EXPONENT.fullmatch(suffix)
        if exponent is None:
            raise QuantityError(
                f"{text!r} is not a quantity: unknown suffix {suffix!r} (use n, u, m, k, M, G, "
                f"T, P, E, Ki, Mi, Gi, Ti, Pi, Ei or an exponent such as e3)"
            )
        amount = _scaled(mantissa, 10, int(exponent.group(1)))
    if amount:
        amount = Fraction(math.ceil(amount / NANO)) * NANO  # Kubernetes rounds up to nanos
    return -amount if sign == "-" else amount


def _scaled(mantissa: Fraction, base: int, exponent: int) -> Fraction:
    if not mantissa:  # zero at any exponent: never raise 10 to it (0e99999999999 would hang)
        return mantissa
    if exponent > _EXPONENT_BOUND:
        raise QuantityError(f"{mantissa}e{exponent} is larger than a quantity can hold (2^63-1)")
    if exponent < -_EXPONENT_BOUND:
        return NANO  # anything that small rounds up to the smallest quantity
    return mantissa * Fraction(base) ** exponent


def value(amount: Fraction) -> int:
    """Quantity.Value(): rounded up to a whole number."""
    return math.ceil(amount)


def milli_value(amount: Fraction) -> int:
    """Quantity.MilliValue(): rounded up to whole thousandths."""
    return math.ceil(amount * 1000)


def whole_number(raw: object, where: str) -> int:
    """A request that must be a whole count (GPUs, MiB, percent): Value(), never negative;
    QuantityError naming `where` otherwise."""
    try:
        amount = parse_quantity(raw)
    except QuantityError as exc:
        raise QuantityError(f"{where}: {exc}") from None
    if amount < 0:
        raise QuantityError(f"{where}: must not be negative, got {raw!r}")
    return value(amount)
