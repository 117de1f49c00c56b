"""TEMPORARY (drop at merge): ``bytes_of`` lives in ``entrenar_pg.collectives.common``."""

from ..collectives.common import bytes_of

__all__ = ["bytes_of"]
