// Declares NVIDIA's test-only entry points as nccl-extensions' nccl_ep_test_internal.h does (C++
// linkage, no extern "C") and links against epflow's libnccl_ep.so: each resolves, and on values
// that name no live handle or group each answers "absent" (-1, NULL, an error code) instead of
// reading them. Exit status 0 = every check passed.
#include <cstdint>
#include <cstdio>

#include "nccl_ep.h"

const int32_t* ncclEpHandle_test_getSparseToDenseMap(ncclEpHandle_t handle);
int ncclEpHandle_test_getNumTopk(ncclEpHandle_t handle);
int ncclEpHandle_test_getMaxTokensPerRank(ncclEpHandle_t handle);
int ncclEpHandle_test_getNRanksPerNode(ncclEpHandle_t handle);
int ncclEpHandle_test_getExpertsPerRank(ncclEpHandle_t handle);
ncclResult_t ncclEpHandle_test_getNumRecvTokens(ncclEpHandle_t handle, unsigned int* num_recv_tokens);
void ncclEpHandle_test_clearTopkIdx(ncclEpHandle_t handle);
ncclResult_t ncclEpGroup_test_setMaxDynamicSmem(ncclEpGroup_t group, int max_dynamic_smem);
int ncclEpGroup_test_getLastLlCombineWarpsPerGroup(ncclEpGroup_t group);

#include "check.h"

int main() {
    int token = 0;
    ncclEpHandle_t stale = reinterpret_cast<ncclEpHandle_t>(&token);
    ncclEpGroup_t no_group = reinterpret_cast<ncclEpGroup_t>(&token);
    unsigned int n = 7;
    CHECK(ncclEpHandle_test_getNumTopk(stale) == -1);
    CHECK(ncclEpHandle_test_getMaxTokensPerRank(stale) == -1);
    CHECK(ncclEpHandle_test_getNRanksPerNode(stale) == -1);
    CHECK(ncclEpHandle_test_getExpertsPerRank(stale) == -1);
    CHECK(ncclEpHandle_test_getNumRecvTokens(stale, &n) == ncclInvalidArgument && n == 7);
    CHECK(ncclEpHandle_test_getNumRecvTokens(stale, nullptr) == ncclInvalidArgument);
    CHECK(ncclEpHandle_test_getSparseToDenseMap(stale) == nullptr);
    ncclEpHandle_test_clearTopkIdx(stale);
    CHECK(ncclEpGroup_test_setMaxDynamicSmem(no_group, 1024) == ncclInvalidArgument);
    CHECK(ncclEpGroup_test_getLastLlCombineWarpsPerGroup(no_group) == -1);
    if (failures == 0) std::printf("test_hooks: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
