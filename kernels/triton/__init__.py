"""The Triton MoE kernels, one module per job, in the order a layer call runs them:

- :mod:`.variant`: the weight and activation keys read as the kernels' constexpr choices (KernelVariant).
- :mod:`.layout`: the weights' last conversion step into the kernels' private layout (TritonWeightLayout).
- :mod:`.experts`: the Experts classes the kernel specs name; :mod:`.layer`: the layer's custom ops.
- :mod:`.plan`: what a call launches; :mod:`.tile_config`: tile configs (tuned tables, defaults, fitting).
- :mod:`.chain`: the launch chain (programmatic dependent launch); :mod:`.align`: alignment;
  :mod:`.activation_quant`, :mod:`.fp8_act`, :mod:`.quant_math`: activation quantisation;
  :mod:`.launch`: the GEMM launchers; :mod:`.gemm`, :mod:`.gemm_common`, :mod:`.decode_gemv`,
  :mod:`.dequant_ptx`, :mod:`.fp4_dequant`: the GEMM kernels; :mod:`.reduce`: the top-k sum.
- :mod:`.api`: the public surface for tools (launch a layer with given tile configs, read tile tables).
"""
