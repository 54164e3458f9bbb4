"""librdkafka's built-in mock cluster, driven through its C API (``rdkafka_mock.h``).

A second Kafka-protocol implementation, shipped inside the confluent-kafka wheel
(the same librdkafka the relay's producer uses). Unlike tansu it can be told to
answer the next requests of an API with a given error, through the documented
``rd_kafka_mock_push_request_errors``: a broker-side fault, like killing the broker,
used where no available broker produces the error by itself.
"""

from __future__ import annotations

import ctypes
import glob
import os
from types import TracebackType

import confluent_kafka

PRODUCE_API_KEY = 0
_RD_KAFKA_PRODUCER = 0


def _library() -> ctypes.CDLL:
    package = os.path.dirname(confluent_kafka.__file__)
    candidates = sorted(glob.glob(os.path.join(package, os.pardir, "confluent_kafka.libs", "librdkafka*.so*")))
    if not candidates:
        raise RuntimeError("librdkafka of the confluent-kafka wheel not found")
    lib = ctypes.CDLL(candidates[0])
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.restype = ctypes.c_int
    lib.rd_kafka_conf_set.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_topic_create.restype = ctypes.c_int
    lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    return lib


class MockCluster:
    """A one-broker mock cluster on a loopback port, for one test."""

    def __init__(self, brokers: int = 1) -> None:
        self._lib = _library()
        errstr = ctypes.create_string_buffer(512)
        conf = self._lib.rd_kafka_conf_new()
        # The handle only hosts the cluster: no bootstrap servers, no notice about it.
        self._lib.rd_kafka_conf_set(conf, b"log_level", b"3", errstr, 512)
        self._rk = self._lib.rd_kafka_new(_RD_KAFKA_PRODUCER, conf, errstr, 512)
        if not self._rk:
            raise RuntimeError(f"rd_kafka_new failed: {errstr.value.decode()}")
        self._cluster = self._lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        if not self._cluster:
            self._lib.rd_kafka_destroy(self._rk)
            raise RuntimeError("rd_kafka_mock_cluster_new failed")
        self.bootstrap_servers = self._lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()

    def create_topic(self, name: str, partitions: int = 1) -> None:
        err = self._lib.rd_kafka_mock_topic_create(self._cluster, name.encode(), partitions, 1)
        if err:
            raise RuntimeError(f"rd_kafka_mock_topic_create failed: error {err}")

    def fail_next_produce_requests(self, *error_codes: int) -> None:
        """The next ``len(error_codes)`` Produce requests (any client) get these errors."""
        self._lib.rd_kafka_mock_push_request_errors(
            ctypes.c_void_p(self._cluster),
            ctypes.c_int16(PRODUCE_API_KEY),
            ctypes.c_size_t(len(error_codes)),
            *[ctypes.c_int(code) for code in error_codes],
        )

    def close(self) -> None:
        if self._cluster:
            self._lib.rd_kafka_mock_cluster_destroy(self._cluster)
            self._cluster = None
        if self._rk:
            self._lib.rd_kafka_destroy(self._rk)
            self._rk = None

    def __enter__(self) -> MockCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
