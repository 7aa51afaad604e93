#pragma once
// --moe-a2a-backend names, Fulcrum's and SGLang's, onto the token dispatchers of token_dispatcher.hpp.
// SGLang's "none" moves tokens by all-gather / all-reduce: Fulcrum's allgather. Its DeepEP-class backends
// (deepep, mooncake, mori, nixl: each token only to the ranks holding its chosen expert) are what Fulcrum's
// alltoall does; as in SGLang, such a backend makes the EP group span the ranks of a stage (--ep defaults to
// --tp). SGLang's hardware-bound backends (ascend_fuseep, flashinfer, megamoe) have no counterpart here.
#include <string>
#include <string_view>

namespace fulcrum::engine {

// The one capability predicate: does `name` dispatch all-to-all (the DeepEP-class path)? Fulcrum's alltoall
// and SGLang's deepep, mooncake, mori, nixl.
bool is_deepep_class_backend(std::string_view name);

struct MoeA2aBackend {
  std::string given;       // the name on the command line
  std::string dispatcher;  // make_token_dispatcher's name: allgather | alltoall
  bool deepep_class = false;
};

// Throws fulcrum::Error naming the accepted names for anything else.
MoeA2aBackend resolve_moe_a2a_backend(std::string_view name);

// "allgather, alltoall, none, deepep, mooncake, mori, nixl" (help text and errors).
std::string moe_a2a_backend_names();

}  // namespace fulcrum::engine
