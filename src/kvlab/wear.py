"""Drive wear: a write rate as drive writes per day (DWPD) and the rated life it implies.

One arithmetic for the restore planner's bill (a save rate it predicts) and a campaign's
report (the bytes a run wrote over its wall time). A drive's endurance is rated either in
drive writes per day over its warranty period or in terabytes written (TBW) per drive; the
two are the same figure: TBW = DWPD x capacity (TB) x 365 x warranty years.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_DAY = 86400
DAYS_PER_YEAR = 365  # as drive makers rate TBW from DWPD
DEFAULT_WARRANTY_YEARS = 5.0  # enterprise NVMe drives are rated over five years


@dataclass(frozen=True)
class Drives:
    """The drives a tier writes to: how many, how large (decimal TB) and their rated endurance:
    exactly one of `dwpd` (drive writes per day over `warranty_years`) or `tbw` (per drive)."""

    count: int
    capacity_tb: float
    dwpd: float | None = None
    tbw: float | None = None
    warranty_years: float = DEFAULT_WARRANTY_YEARS
    model: str | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or self.capacity_tb <= 0 or self.warranty_years <= 0:
            raise ValueError(f"drives: count >= 1, capacity_tb > 0 and warranty_years > 0 (got {self})")
        if (self.dwpd is None) == (self.tbw is None):
            raise ValueError(
                "drives: give exactly one of dwpd (rated drive writes per day) or tbw "
                "(rated terabytes written per drive)"
            )
        if (self.dwpd if self.dwpd is not None else self.tbw) <= 0:  # type: ignore[operator]
            raise ValueError("drives: the rating (dwpd or tbw) must be > 0")

    def describe(self) -> str:
        """What they are and how they are rated, as plans and reports print it."""
        rating = f"{self.dwpd:g} DWPD" if self.dwpd is not None else f"{self.tbw:g} TBW each ({self.rated_dwpd:.2f} DWPD)"
        return (f"{self.count} x {self.model or 'drive'} of {self.capacity_tb:g} TB, rated {rating} "
                f"over {self.warranty_years:g} years")

    @property
    def capacity_bytes(self) -> float:
        return self.count * self.capacity_tb * 1e12

    @property
    def rated_dwpd(self) -> float:
        if self.dwpd is not None:
            return self.dwpd
        assert self.tbw is not None
        return self.tbw / (self.capacity_tb * DAYS_PER_YEAR * self.warranty_years)

    @property
    def rated_bytes(self) -> float:
        """What all the drives are rated to absorb over their warranty period."""
        return self.rated_dwpd * self.capacity_bytes * DAYS_PER_YEAR * self.warranty_years


@dataclass(frozen=True)
class Wear:
    bytes_per_day: float
    drive_writes_per_day: float
    rated_dwpd: float
    # Years until the drives have absorbed their rated writes at this rate (None: no writes).
    rated_life_years: float | None


def bytes_per_day(written_bytes: float, seconds: float) -> float | None:
    """A measured write rate as bytes a day; None without a duration."""
    return written_bytes / seconds * SECONDS_PER_DAY if seconds > 0 else None


def wear(bytes_a_day: float, drives: Drives) -> Wear:
    """What writing bytes_a_day to `drives` (spread over all of them) does to them."""
    dwpd = bytes_a_day / drives.capacity_bytes
    life = drives.warranty_years * drives.rated_dwpd / dwpd if dwpd > 0 else None
    return Wear(
        bytes_per_day=bytes_a_day,
        drive_writes_per_day=dwpd,
        rated_dwpd=drives.rated_dwpd,
        rated_life_years=life,
    )
