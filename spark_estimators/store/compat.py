"""horovod.spark's Store methods that ours spell differently, for code ported from horovod.

=========================  ===============================================================
horovod                    here
=========================  ===============================================================
``get_full_path(p)``       the URL Spark and other tools take: ``file:///abs/p`` for local
                           and DBFS stores, ``hdfs://nn:8020/p``, ``s3://bucket/p`` (as
                           :meth:`~spark_estimators.store.io.StoreIO.full_path` elsewhere)
``get_localized_path(p)``  the path on the store's own filesystem client (``/abs/p``,
                           ``bucket/p``, ``/p`` on HDFS, the FUSE path of a DBFS path):
                           :meth:`~spark_estimators.store.io.StoreIO.fs_path`
``read(p)``                :meth:`~spark_estimators.store.io.StoreIO.read_bytes`
``is_parquet_dataset(p)``  True when ``p`` is a Parquet file or a directory with Parquet files
``get_parquet_dataset(p)`` :class:`pyarrow.parquet.ParquetDataset` through the store's client
=========================  ===============================================================

One difference: horovod resolves a relative path against the working directory; here, as in
every other Store method, a relative path is taken under the store's prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_estimators.errors import StoreError
from spark_estimators.store.io import StoreIO

if TYPE_CHECKING:
    import pyarrow.parquet as pq


class HorovodStoreMethods(StoreIO):
    """The horovod names (see the module docstring); every store and remote view has them."""

    def get_full_path(self, path: str) -> str:
        """``path`` as a full URL (relative paths are under the prefix).

        >>> from spark_estimators.store import HDFSStore
        >>> HDFSStore("hdfs://nn:8020/user/me").get_full_path("/output")
        'hdfs://nn:8020/output'
        """
        return self.full_path(path)

    def get_localized_path(self, path: str) -> str:
        """``path`` on the store's filesystem client, without scheme or host.

        >>> from spark_estimators.store import HDFSStore
        >>> HDFSStore("hdfs://nn:8020/user/me").get_localized_path("hdfs://nn:8020/user/x")
        '/user/x'
        """
        return self.fs_path(path)

    def read(self, path: str) -> bytes:
        """The whole content of the file at ``path`` (horovod's name of ``read_bytes``)."""
        return self.read_bytes(path)

    def get_parquet_dataset(self, path: str) -> pq.ParquetDataset:
        """A :class:`pyarrow.parquet.ParquetDataset` of ``path``, read through this store.

        Raises
        ------
        StoreError
            When ``path`` does not exist or holds no readable Parquet data.
        """
        import pyarrow.parquet as pq

        try:
            with self._io_errors("open the Parquet dataset", path):
                return pq.ParquetDataset(self.fs_path(path), filesystem=self.filesystem)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, ValueError, ...
            raise StoreError(
                f"{path!r} in {self!r} is not a Parquet dataset: {exc}; give the directory that "
                "holds the part-*.parquet files (e.g. store.get_train_data_path(idx))"
            ) from exc

    def is_parquet_dataset(self, path: str) -> bool:
        """True when ``path`` is a Parquet file, or a directory holding Parquet files."""
        try:
            return bool(self.get_parquet_dataset(path).files)
        except StoreError:
            return False
