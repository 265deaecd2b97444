"""Writes a Protobuf topic and an Avro topic with librdkafka (the
confluent-kafka wheel), as another team's services would, each payload
encoded by that format's own Python library: Protobuf by `protobuf`
(Google's runtime, the message type built from a descriptor at run time),
half plain and half in the Confluent wire format (magic byte 0, schema id 1,
message indexes [0]); Avro by `fastavro`, in the Confluent wire format
(magic byte 0, schema id 7). Every event is written twice with the same
message_id, as a producer that retried would. Prints one JSON line: what was
produced, for the test to check against.

Usage: librdkafka_formats.py BROKER PROTOBUF_TOPIC AVRO_TOPIC
"""

import io
import json
import struct
import sys

import fastavro
from confluent_kafka import Producer
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

AVRO_SCHEMA = {
    "type": "record",
    "name": "Payment",
    "namespace": "billing",
    "fields": [
        {"name": "payment_id", "type": "string"},
        {"name": "amount", "type": "long"},
        {"name": "method", "type": {"type": "enum", "name": "Method", "symbols": ["CARD", "TRANSFER"]}},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}


def order_class():
    """The message type `shop.OrderCreated { string order_id = 1; int64
    total = 2; repeated string items = 3; }`, built from its descriptor."""
    file = descriptor_pb2.FileDescriptorProto(name="shop.proto", package="shop", syntax="proto3")
    message = file.message_type.add(name="OrderCreated")
    label = descriptor_pb2.FieldDescriptorProto
    message.field.add(name="order_id", number=1, type=label.TYPE_STRING, label=label.LABEL_OPTIONAL)
    message.field.add(name="total", number=2, type=label.TYPE_INT64, label=label.LABEL_OPTIONAL)
    message.field.add(name="items", number=3, type=label.TYPE_STRING, label=label.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.OrderCreated"))


def main() -> None:
    broker, proto_topic, avro_topic = sys.argv[1], sys.argv[2], sys.argv[3]
    producer = Producer({"bootstrap.servers": broker, "linger.ms": 20, "compression.type": "lz4"})
    OrderCreated = order_class()
    orders, payments, records = [], [], 0
    for i in range(6):
        order = OrderCreated(order_id=f"pb-{i}", total=1000 + i, items=[f"sku-{i}", "sku-x"])
        body = order.SerializeToString()
        framed = i % 2 == 1
        if framed:
            # Confluent: magic 0, schema id 1, message indexes [0] (one 0)
            body = b"\x00" + struct.pack(">I", 1) + b"\x00" + body
        for _ in range(2):
            producer.produce(
                proto_topic,
                body,
                key=f"customer-{i}".encode(),
                partition=0,
                headers=[("message_id", f"pb-{i}".encode()), ("event_type", b"order.created")],
            )
            records += 1
        orders.append({"order_id": f"pb-{i}", "total": 1000 + i, "items": [f"sku-{i}", "sku-x"], "framed": framed})
    schema = fastavro.parse_schema(AVRO_SCHEMA)
    for i in range(6):
        payment = {
            "payment_id": f"av-{i}",
            "amount": 50 * (i + 1),
            "method": "CARD" if i % 2 == 0 else "TRANSFER",
            "note": None if i % 3 == 0 else f"note {i}",
        }
        out = io.BytesIO()
        out.write(b"\x00" + struct.pack(">I", 7))
        fastavro.schemaless_writer(out, schema, payment)
        for _ in range(2):
            producer.produce(
                avro_topic,
                out.getvalue(),
                key=f"customer-{i}".encode(),
                partition=0,
                headers=[("message_id", f"av-{i}".encode())],
            )
            records += 1
        payments.append(payment)
    left = producer.flush(30)
    if left:
        sys.exit(f"{left} records not delivered")
    print(
        json.dumps(
            {
                "orders": orders,
                "payments": payments,
                "records": records,
                "avro_schema": json.dumps(AVRO_SCHEMA),
            }
        )
    )


if __name__ == "__main__":
    main()
