// Checks that epflow's generated nccl_ep.h compiles as C++17 and serves a C++ program: the
// static assertions, the extern "C" linkage (the program links against libnccl_ep.so), the
// _INIT macros in declarations, assignments and expressions, and argument errors without a GPU.
// Exit status 0 = every check passed.
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "nccl_ep.h"

static_assert(std::is_standard_layout<ncclEpGroupConfig_t>::value, "C layout");
static_assert(std::is_trivially_copyable<ncclEpTensor_t>::value, "C layout");
#ifndef EPFLOW_NCCL_EP_HAVE_NCCL_H
static_assert(ncclTimeout == 8 && ncclNumResults == 9, "NCCL 2.30's ncclResult_t");
#endif

#include "check.h"

int main(int argc, char** argv) {
    bool no_gpu = argc > 1 && std::strcmp(argv[1], "--no-gpu") == 0;
    int version = -1;
    CHECK(ncclEpGetVersion(&version) == ncclSuccess);
    CHECK(version == NCCL_EP_VERSION_CODE && version == 100);
    CHECK(ncclEpGetVersion(nullptr) == ncclInvalidArgument);

    // The _INIT macros: declaration, assignment, expression.
    auto cfg = NCCL_EP_GROUP_CONFIG_INIT;
    static_assert(std::is_same<decltype(cfg), ncclEpGroupConfig_t>::value, "INIT's type");
    CHECK(cfg.size == sizeof(ncclEpGroupConfig_t) && cfg.magic == NCCL_EP_MAGIC);
    CHECK(cfg.version == NCCL_EP_API_VERSION && cfg.num_experts == 0 && cfg.timeout_ns == 0);
    ncclEpDispatchConfig_t dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
    dcfg.send_only = 1;
    dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
    CHECK(dcfg.send_only == 0 && dcfg.size == sizeof dcfg);
    CHECK((NCCL_EP_COMBINE_CONFIG_INIT).magic == NCCL_EP_MAGIC);
    ncclEpTensor_t t = NCCL_EP_TENSOR_INIT;
    CHECK(t.magic == NCCL_EP_TENSOR_MAGIC && t.data == nullptr && t.sizes == nullptr && t.ndim == 0);

    // Library-owned descriptors.
    size_t dims[2] = {4, 7168};
    ncclEpTensor_t* owned = nullptr;
    CHECK(ncclEpTensorAlloc(&owned, 2, ncclBfloat16, dims, nullptr) == ncclSuccess);
    CHECK(owned != nullptr && owned->ndim == 2 && owned->sizes[1] == 7168);
    CHECK(ncclEpTensorDestroy(owned) == ncclSuccess);
    CHECK(ncclEpTensorDestroy(&t) == ncclInvalidArgument);

    // Config checks come before the communicator is touched.
    ncclComm_t not_a_comm = reinterpret_cast<ncclComm_t>(&failures);
    ncclEpGroup_t group = nullptr;
    cfg.num_experts = 16;
    cfg.max_dispatch_tokens_per_rank = 128;
    cfg.max_token_bytes = 7168 * 2;
    auto bad = cfg;
    bad.version = 7;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    CHECK(group == nullptr);

    // Values that name no live handle or group.
    auto stale = reinterpret_cast<ncclEpHandle_t>(&failures);
    CHECK(ncclEpHandleDestroy(stale) == ncclInvalidArgument);
    CHECK(ncclEpHandleDestroy(stale) == ncclInvalidArgument);
    CHECK(ncclEpComplete(stale, nullptr, nullptr) == ncclInvalidArgument);
    auto stale_group = reinterpret_cast<ncclEpGroup_t>(&version);
    CHECK(ncclEpGroupDestroy(stale_group) == ncclInvalidArgument);

    if (no_gpu) {
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &cfg) == ncclInvalidUsage);
    }
    if (failures == 0) std::printf("api_check_cpp: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
