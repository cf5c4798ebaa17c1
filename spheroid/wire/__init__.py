"""The spheroid wire protocol, sans I/O: frames, messages, tensors and tensor streams.

Imports neither asyncio nor the model; proto/PROTOCOL.md is the language-neutral specification.
"""

from .codec import MAX_FRAME, Budget, Decoder, EncodedTensor, Received, decode_body, encode
from .errors import ProtocolError
from .messages import SCHEMAS, VERSION, validate
from .streams import Encoded, Outgoing, StreamAssembler, encode_stream, stream_frames, through_codec
from .tensors import decode_tensor, encode_tensor, encode_tensor_pieces

__all__ = [
    "MAX_FRAME", "SCHEMAS", "VERSION", "Budget", "Decoder", "Encoded", "EncodedTensor", "Outgoing", "ProtocolError",
    "Received", "StreamAssembler", "decode_body", "decode_tensor", "encode", "encode_stream", "encode_tensor",
    "encode_tensor_pieces", "stream_frames", "through_codec", "validate",
]
