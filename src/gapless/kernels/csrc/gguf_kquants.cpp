// The K-quant block types (256 values a super-block). Placeholder until they land.
#include "gguf_blocks.h"

namespace gapless_gguf {

const BlockType* kquant_type(int64_t) { return nullptr; }

void quantize_act_q8k(const float*, ActQ8K*, int64_t) {}

}  // namespace gapless_gguf
