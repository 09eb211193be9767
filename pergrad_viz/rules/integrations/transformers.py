"""Hugging Face ``transformers`` layers: ``Conv1D`` (GPT-2's Linear with its weight stored (in, out)) and the
RMSNorm-style layers of the Llama family and of T5.

The RMSNorm classes are listed by path; every one was checked to have, in transformers 5.24, a forward identical to
the copy below it is registered with (``forward_like``, compared as compiled code when the class is first looked up,
so a class whose forward differs in another release gets no rule). Gemma-style layers (``(1 + weight)``, computed in
float32 and cast back) are not registered.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pergrad_viz.rules.linear import LinearInOutGhost, linear_in_out, linear_in_out_weighted_sum
from pergrad_viz.rules.normalization import affine_sums
from pergrad_viz.rules.registry import register, register_ghost, register_weighted_sum

# ----------------------------------------------------------------------------------------------------------- Conv1D

CONV1D = "transformers.pytorch_utils.Conv1D"


def _conv1d_forward(self, x):  # transformers.pytorch_utils.Conv1D.forward, verbatim
    size_out = x.size()[:-1] + (self.nf,)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x


@register(CONV1D, features=lambda module: 1, forward_like=_conv1d_forward)
def conv1d(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
           out: dict[str, torch.Tensor]) -> None:
    """y = x W + b with W (in, out): activation (B, *, in), grad_output (N, B, *, out)."""
    linear_in_out(module, activation, grad_output, out)


register_ghost(CONV1D, forward_like=_conv1d_forward)(LinearInOutGhost)
register_weighted_sum(CONV1D, forward_like=_conv1d_forward, writes_fresh=True)(linear_in_out_weighted_sum)

# -------------------------------------------------------------------------------------------------------- RMSNorm

_MODELS = "transformers.models."

# weight * normalised(x computed in float32).to(input dtype)
LLAMA_RMS_NORMS = tuple(_MODELS + p for p in (
    "llama.modeling_llama.LlamaRMSNorm", "mistral.modeling_mistral.MistralRMSNorm",
    "mixtral.modeling_mixtral.MixtralRMSNorm", "ministral.modeling_ministral.MinistralRMSNorm",
    "qwen2.modeling_qwen2.Qwen2RMSNorm", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeRMSNorm",
    "qwen2_vl.modeling_qwen2_vl.Qwen2VLRMSNorm", "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRMSNorm",
    "qwen3.modeling_qwen3.Qwen3RMSNorm", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    "phi3.modeling_phi3.Phi3RMSNorm", "granite.modeling_granite.GraniteRMSNorm",
    "granitemoe.modeling_granitemoe.GraniteMoeRMSNorm", "glm.modeling_glm.GlmRMSNorm", "glm4.modeling_glm4.Glm4RMSNorm",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2RMSNorm", "deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm",
    "olmoe.modeling_olmoe.OlmoeRMSNorm", "smollm3.modeling_smollm3.SmolLM3RMSNorm",
    "mamba.modeling_mamba.MambaRMSNorm", "mamba2.modeling_mamba2.Mamba2RMSNorm", "jamba.modeling_jamba.JambaRMSNorm",
    "bamba.modeling_bamba.BambaRMSNorm", "zamba.modeling_zamba.ZambaRMSNorm", "zamba2.modeling_zamba2.Zamba2RMSNorm",
    "falcon_h1.modeling_falcon_h1.FalconH1RMSNorm", "diffllama.modeling_diffllama.DiffLlamaRMSNorm",
    "chameleon.modeling_chameleon.ChameleonRMSNorm", "mllama.modeling_mllama.MllamaTextRMSNorm",
    "idefics2.modeling_idefics2.Idefics2RMSNorm", "idefics3.modeling_idefics3.Idefics3RMSNorm",
    "pixtral.modeling_pixtral.PixtralRMSNorm",
))

# (weight * normalised(x computed in float32)).to(input dtype)
OLMO_RMS_NORMS = tuple(_MODELS + p for p in (
    "olmo2.modeling_olmo2.Olmo2RMSNorm", "olmo3.modeling_olmo3.Olmo3RMSNorm",
    "flex_olmo.modeling_flex_olmo.FlexOlmoRMSNorm", "gpt_oss.modeling_gpt_oss.GptOssRMSNorm",
))

# weight * (x * rsqrt(mean of x^2 in float32 + eps)), cast to a half-precision weight's dtype
T5_LAYER_NORMS = tuple(_MODELS + p for p in (
    "t5.modeling_t5.T5LayerNorm", "mt5.modeling_mt5.MT5LayerNorm", "umt5.modeling_umt5.UMT5LayerNorm",
    "longt5.modeling_longt5.LongT5LayerNorm", "switch_transformers.modeling_switch_transformers."
    "SwitchTransformersLayerNorm", "pix2struct.modeling_pix2struct.Pix2StructLayerNorm",
    "udop.modeling_udop.UdopLayerNorm", "pop2piano.modeling_pop2piano.Pop2PianoLayerNorm",
    "idefics.modeling_idefics.IdeficsRMSNorm",
))


def _llama_forward(self, hidden_states):  # LlamaRMSNorm.forward, verbatim
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _olmo_forward(self, hidden_states):  # Olmo2RMSNorm.forward, verbatim
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _t5_forward(self, hidden_states):  # T5LayerNorm.forward, verbatim (comments left out)
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states


def _rms_in_float32(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x (B, ..., d) in float32 divided by its root mean square over d (with the module's eps), as these forwards."""
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)


def _scale(module: nn.Module, xhat: torch.Tensor, grad_output: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """The weight's gradient of weight * xhat: grad_output (N, B, ..., d) times xhat (B, ..., d), summed per d."""
    shape = module.weight.shape
    affine_sums(xhat, grad_output, math.prod(xhat.shape[1:]) // shape.numel(), out, shape)


@register(*LLAMA_RMS_NORMS, features=lambda module: 1, forward_like=_llama_forward)
def llama_rms_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                   out: dict[str, torch.Tensor]) -> None:
    _scale(module, _rms_in_float32(module, activation).to(activation.dtype), grad_output, out)


@register(*OLMO_RMS_NORMS, features=lambda module: 1, forward_like=_olmo_forward)
def olmo_rms_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                  out: dict[str, torch.Tensor]) -> None:
    _scale(module, _rms_in_float32(module, activation), grad_output, out)


@register(*T5_LAYER_NORMS, features=lambda module: 1, forward_like=_t5_forward)
def t5_layer_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                  out: dict[str, torch.Tensor]) -> None:
    variance = activation.to(torch.float32).pow(2).mean(-1, keepdim=True)
    xhat = activation * torch.rsqrt(variance + module.variance_epsilon)
    if module.weight.dtype in (torch.float16, torch.bfloat16):
        xhat = xhat.to(module.weight.dtype)
    _scale(module, xhat, grad_output, out)
