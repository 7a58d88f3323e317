"""Small helpers every layer uses."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b, in integers."""
    return -(-a // b)
