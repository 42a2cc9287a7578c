"""Audio clips: checked from their WAV header on every rank, turned into log-mel features only
where an audio encoder consumes them.

Files are PCM WAV (8, 16, 24 or 32-bit integer samples, in the plain or the
extensible header; `mimo.data.wav` reads it); several channels are averaged to mono. The
sample rate must be the feature extractor's (16 kHz by default): audio is not
resampled, a file at another rate is a bad record (convert it first, e.g.
`ffmpeg -i in.mp3 -ac 1 -ar 16000 out.wav`).

Features: transformers' `WhisperFeatureExtractor` in both cases,
* audio encoder from Hugging Face (`model.encoders.<name>.hf`, a Whisper
  directory): the extractor saved with it (`preprocessor_config.json`), else
  Whisper's defaults at the encoder's `num_mel_bins`;
* mimo's own audio encoder: the same Whisper log-mel (16 kHz, 25 ms window,
  10 ms hop, log10, dynamic range 8, scaled to about [-1, 1]) with the
  encoder's `num_mel_bins` bands.
A clip fills the encoder's window of `clip_frames` frames of 10 ms (160
samples): shorter clips are padded with silence (as Whisper does), a clip
longer than the window or shorter than one token's frames is a bad record
(never silently cut).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .images import check_file, file_failure
from .llava import DataError
from .wav import WavError, read_header


class AudioError(ValueError):
    """An audio file that cannot be used; the message is the reason, for the bad-record warning."""


def _extractor(enc):
    """The Whisper feature extractor saved with an HF audio encoder, else Whisper's defaults."""
    from transformers import WhisperFeatureExtractor

    if enc.hf and os.path.isfile(os.path.join(enc.hf, "preprocessor_config.json")):
        return WhisperFeatureExtractor.from_pretrained(enc.hf)
    return WhisperFeatureExtractor(feature_size=enc.num_mel_bins)


class AudioLoader:
    """A WAV path -> float32 [clip_frames, num_mel_bins] log-mel features for the audio encoder.

    `enc` is the audio encoder's config; `field` its path, for the error when its saved
    feature extractor disagrees with it.
    """

    def __init__(self, enc, field: str = "model.encoders.audio"):
        self.fe = _extractor(enc)
        if self.fe.feature_size != enc.num_mel_bins:
            raise DataError(f"error: {field}.num_mel_bins: {enc.num_mel_bins}, but the feature extractor in "
                            f"{enc.hf} makes {self.fe.feature_size} mel bins")
        self.rate, self.hop = self.fe.sampling_rate, self.fe.hop_length
        self.frames, self.mels = enc.clip_frames, enc.num_mel_bins
        self.max_samples = enc.clip_frames * self.hop
        self.min_samples = enc.frames_per_token * self.hop

    def check(self, path: str) -> None:
        """Raise AudioError unless `path` is a PCM WAV at the right rate and of a usable length.

        Reads the header and the file's size only, so every rank can afford it and all ranks
        reach the same verdict on a record from the record alone.
        """
        check_file(path, "audio", AudioError)
        try:
            with open(path, "rb") as f:
                head = read_header(f)
        except OSError as exc:
            raise file_failure(path, exc, "audio", AudioError) from None
        except WavError as exc:
            raise AudioError(f"unreadable audio {path}: {exc} (PCM WAV expected)") from None
        if not head.complete:  # the header promises more samples than the file holds
            raise AudioError(f"unreadable audio {path}: truncated (header says {head.frames} samples)")
        rate, n = head.rate, head.frames
        if rate != self.rate:
            raise AudioError(f"audio {path}: sample rate {rate} Hz, expected {self.rate} Hz (resample it first)")
        if n > self.max_samples:
            raise AudioError(f"audio {path} too long: {n / rate:.3f} s, the encoder's window is "
                             f"{self.max_samples / rate:.3f} s ({self.frames} frames)")
        if n < self.min_samples:
            raise AudioError(f"audio {path} too short: {n} samples, at least {self.min_samples} "
                             "(one token's frames)")

    def __call__(self, path: str) -> torch.Tensor:
        try:
            with open(path, "rb") as f:
                head = read_header(f)
                f.seek(head.data_offset)
                raw = f.read(head.data_bytes)
        except OSError as exc:
            raise file_failure(path, exc, "audio", AudioError) from None
        except WavError as exc:  # the file changed since its header was checked
            raise AudioError(f"unreadable audio {path}: {exc} (PCM WAV expected)") from None
        if len(raw) < head.data_bytes:  # the data ends before the header's count
            raise AudioError(f"unreadable audio {path}: truncated ({len(raw)} bytes of samples, the header "
                             f"says {head.data_bytes})")
        channels, width = head.channels, head.width
        samples = _pcm_to_float(raw, width).reshape(-1, channels).mean(axis=1)
        feats = self.fe(samples, sampling_rate=self.rate, max_length=self.max_samples, padding="max_length",
                        truncation=True, return_tensors="pt")["input_features"][0]
        return feats.transpose(0, 1).contiguous().float()  # [mels, frames] -> [frames, mels]


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    """Little-endian PCM samples -> float32 in [-1, 1) (WAV: 8-bit unsigned, wider signed)."""
    if width == 1:
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 3:  # no numpy dtype: sign-extend three bytes into the top of an int32
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        x = (b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)
        return x.astype(np.float32) / 2.0 ** 31
    dtype = {2: "<i2", 4: "<i4"}[width]
    return np.frombuffer(raw, dtype=dtype).astype(np.float32) / 2.0 ** (8 * width - 1)
