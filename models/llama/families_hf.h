// The Llama architecture's families in Hugging Face's config.json (families_hf.cpp): the model keys' names there,
// each family's writer and reader. Used by families.cpp's table only.
#pragma once
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/model.h"

namespace mt::llama_hf {

// The model keys every family of the architecture stores, then the family's own lists below (functions: the
// registry of families may be made before a global of this file would be).
std::vector<HfName> names(std::initializer_list<std::vector<HfName>> own);
const std::vector<HfName>& kWindow();
const std::vector<HfName>& kRouter();
const std::vector<HfName>& kMixtralMoe();
const std::vector<HfName>& kQwenMoe();
const std::vector<HfName>& kSharedExpert();
const std::vector<HfName>& kGemma();
const std::vector<HfName>& kGemma3();
const std::vector<HfName>& kDeepseek();

nlohmann::json llama_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json mistral_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json qwen_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json qwen3_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json mixtral_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json phi3_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json gemma_to_hf(const ModelFamily& f, const ModelConfig& m);
nlohmann::json deepseek_to_hf(const ModelFamily& f, const ModelConfig& m);

ModelConfig llama_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig mistral_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig qwen2_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig qwen3_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig mixtral_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig qwen2_moe_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig qwen3_moe_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig phi3_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig gemma_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);
ModelConfig deepseek_from_hf(const ModelFamily& f, const nlohmann::json& j, const std::string& file);

}  // namespace mt::llama_hf
